"""Device functions of the Triton elementwise kernels: math primitives, activations and their derivatives,
unary_chain ops, and the Philox dropout mask. The formulas mirror csrc/common/pointwise_math.h and
csrc/common/philox.h so that every backend computes the same thing.

On a GPU the transcendental functions come from libdevice (IEEE-accurate, unlike tl.exp / tl.sin, which lower to
the approximate PTX instructions). Triton's interpreter cannot call libdevice, so under TRITON_INTERPRET=1 the
same functions come from tl.math, with tanh and pow (absent from tl.math) computed in float64. Divisions go
through _div and square roots through _sqrt: correctly rounded, as in eager (Triton's float32 `/` and tl.sqrt are
not).
"""
import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

INTERPRET = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")
# unary_chain op code of an empty slot (fused/_codes.py numbers the real ops from 0).
NONE: tl.constexpr = tl.constexpr(-1)


# ---- launch parameters and indexing shared by the kernels ----
BLOCK = 2048  # elements per program of the flat kernels
NUM_WARPS = 8
TILE = 2048  # elements per program of the [rows, cols] kernels
CHAIN_SLOTS = 16  # unary_chain ops per kernel pass
BIAS_GRAD_PROGRAMS = 1024  # about how many programs the bias-gradient kernels launch (fixed: deterministic)


def math_dtype(t):
    return tl.float64 if t.dtype == torch.float64 else tl.float32


def math_torch_dtype(t):
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def rows_cols(t):
    """t as [rows, cols] with cols its last dim (a 0-d tensor is one row of one)."""
    cols = t.shape[-1] if t.dim() else 1
    return (t.numel() // cols if cols else 0), cols


def needs_i64(*sizes):
    return max(sizes) >= 2**31


def tile(cols):
    block_c = min(triton.next_power_of_2(max(cols, 1)), 1024)
    return TILE // block_c if block_c < TILE else 1, block_c


@triton.jit
def flat_offsets(I64: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    if I64:
        pid = pid.to(tl.int64)
    return pid * BLOCK + tl.arange(0, BLOCK)


@triton.jit
def program_2d(inner, I64: tl.constexpr = False):
    """(outer, inner) indices of this program in a grid folded into axis 0 (inner fastest). Grid axes 1 and 2
    stop at 65535 programs, which a long row or a large batch would pass; axis 0 goes to 2**31 - 1. With I64 both
    come back as int64, so that block index x block size (a row start, a column) cannot wrap past 2**31."""
    pid = tl.program_id(0)
    if I64:
        pid = pid.to(tl.int64)
    return pid // inner, pid % inner


@triton.jit
def tile_index(R0, col_block, rows, BLOCK_R: tl.constexpr, cols, BLOCK_C: tl.constexpr, I64: tl.constexpr):
    """Row and column indices of a BLOCK_R x BLOCK_C tile and its mask; int64 throughout with I64."""
    if I64:
        R0 = R0.to(tl.int64)
        col_block = col_block.to(tl.int64)
    r = R0 + tl.arange(0, BLOCK_R)
    c = col_block * BLOCK_C + tl.arange(0, BLOCK_C)
    return r[:, None], c[None, :], (r[:, None] < rows) & (c[None, :] < cols)


def on_device_of(launcher):
    """Runs the launcher with its first tensor's CUDA device current (a no-op for CPU tensors)."""
    @functools.wraps(launcher)
    def wrapper(first, *args, **kwargs):
        with torch.cuda.device_of(first):
            return launcher(first, *args, **kwargs)
    return wrapper


@triton.jit
def scalar_in(s, MATH: tl.constexpr):
    """A float64 kernel argument as a scalar of the math type (the interpreter passes it as a Python float)."""
    if INTERPRET:
        return tl.full((), s, MATH)
    else:
        return s.to(MATH)


@triton.jit
def to_out(v, DTYPE: tl.constexpr):
    """v converted to the output dtype, rounding to nearest even. The interpreter truncates float32 -> bfloat16,
    so there the rounding is done on the bits (what the GPU's conversion does)."""
    if v.dtype == DTYPE:
        return v
    elif INTERPRET and DTYPE == tl.bfloat16:
        bits = v.to(tl.float32).to(tl.uint32, bitcast=True)
        top = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.uint16)
        return tl.where(v != v, 0x7FC0, top).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return v.to(DTYPE)


# ---- math primitives ----
@triton.jit
def _exp(x):
    if INTERPRET:
        return tl.exp(x)
    else:
        return libdevice.exp(x)


@triton.jit
def _log(x):
    if INTERPRET:
        return tl.log(x)
    else:
        return libdevice.log(x)


@triton.jit
def _sin(x):
    if INTERPRET:
        return tl.sin(x)
    else:
        return libdevice.sin(x)


@triton.jit
def _cos(x):
    if INTERPRET:
        return tl.cos(x)
    else:
        return libdevice.cos(x)


@triton.jit
def _erf(x):
    return tl.math.erf(x)


@triton.jit
def _sqrt(x):
    if x.dtype == tl.float64:
        return tl.sqrt(x)  # float64 sqrt is correctly rounded
    else:
        return tl.sqrt_rn(x)  # tl.sqrt for float32 is the approximate instruction


@triton.jit
def _div(x, y):
    """x / y correctly rounded, as eager and the C++ kernels divide: Triton's `/` on float32 is div.full.f32
    (up to 2 ulp off). float64 `/` is already correctly rounded; 16-bit operands are divided in float32 and the
    quotient rounded back (24 bits are enough for that double rounding to be exact)."""
    q = x / y  # for its type only (Triton's promotion); dropped from the compiled kernel where unused
    if q.dtype == tl.float64:
        return q
    else:
        return tl.math.div_rn(tl.cast(x, tl.float32), tl.cast(y, tl.float32)).to(q.dtype)


@triton.jit
def _rsqrt(x):
    return _div(1.0, _sqrt(x))  # like the C++ kernels (1 / sqrt), not the approximate rsqrt instruction


@triton.jit
def _tanh(x):
    if INTERPRET:
        # float64: tanh = 1 - 2 / (exp(2|x|) + 1), a Taylor series near 0 where that cancels.
        w = x.to(tl.float64)
        a = tl.abs(w)
        a2 = w * w
        big = 1.0 - 2.0 / (tl.exp(2.0 * a) + 1.0)
        small = w * (1.0 + a2 * (-1.0 / 3.0 + a2 * (2.0 / 15.0 + a2 * (-17.0 / 315.0 + a2 * (62.0 / 2835.0)))))
        return tl.where(a < 0.02, small, tl.where(w < 0.0, -big, big)).to(x.dtype)
    else:
        return libdevice.tanh(x)


@triton.jit
def _pow(x, s):
    if INTERPRET:
        # float64: |x|^s = exp2(s log2|x|); negative x: sign by parity for integer s, NaN otherwise (but -inf).
        w = x.to(tl.float64)
        e = s.to(tl.float64)
        mag = tl.exp2(e * tl.log2(tl.abs(w)))
        is_int = tl.floor(e) == e
        odd = is_int & (tl.floor(e * 0.5) != e * 0.5)
        neg = tl.where(is_int, tl.where(odd, -mag, mag), tl.where(w == float("-inf"), mag, float("nan")))
        y = tl.where(w < 0.0, neg, mag)
        return tl.where(e == 0.0, 1.0, y).to(x.dtype)
    else:
        return libdevice.pow(x, s)


@triton.jit
def _sigmoid(x):
    return _div(1.0, 1.0 + _exp(-x))


# ---- activations (fused/_codes.py ACT_CODES) ----
@triton.jit
def act_fwd(x, ACT: tl.constexpr):
    if ACT == 0:  # identity
        return x
    elif ACT == 1:  # relu, NaN-propagating like eager
        return tl.where(x < 0.0, 0.0, x)
    elif ACT == 2:  # gelu (erf)
        return 0.5 * x * (1.0 + _erf(x * 0.70710678118654752440))
    elif ACT == 3:  # gelu_tanh
        inner = 0.79788456080286535588 * (x + 0.044715 * x * x * x)
        return 0.5 * x * (1.0 + _tanh(inner))
    elif ACT == 4:  # silu: x / (1 + exp(-x)), as the C++ kernels and torch
        return _div(x, 1.0 + _exp(-x))
    elif ACT == 5:  # sigmoid
        return _sigmoid(x)
    else:  # tanh
        return _tanh(x)


@triton.jit
def act_grad(x, ACT: tl.constexpr):
    if ACT == 0:
        return tl.full(x.shape, 1.0, x.dtype)
    elif ACT == 1:
        return tl.where(x > 0.0, 1.0, 0.0).to(x.dtype)
    elif ACT == 2:
        cdf = 0.5 * (1.0 + _erf(x * 0.70710678118654752440))
        pdf = _exp(-0.5 * x * x) * 0.39894228040143267794
        return cdf + x * pdf
    elif ACT == 3:
        x2 = x * x
        t = _tanh(0.79788456080286535588 * (x + 0.044715 * x2 * x))
        dinner = 0.79788456080286535588 * (1.0 + (3 * 0.044715) * x2)
        return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * dinner
    elif ACT == 4:
        s = _sigmoid(x)
        return s * (1.0 + x * (1.0 - s))
    elif ACT == 5:
        s = _sigmoid(x)
        return s * (1.0 - s)
    else:
        t = _tanh(x)
        return 1.0 - t * t


# ---- unary_chain ops (fused/_codes.py UNARY_CODES); s is the op's scalar in the math type ----
@triton.jit
def unary_fwd(x, OP: tl.constexpr, s):
    if OP == NONE:
        return x
    elif OP == 0:  # neg
        return -x
    elif OP == 1:  # abs
        return tl.abs(x)
    elif OP == 2:  # square
        return x * x
    elif OP == 3:  # sqrt
        return _sqrt(x)
    elif OP == 4:  # rsqrt
        return _rsqrt(x)
    elif OP == 5:  # exp
        return _exp(x)
    elif OP == 6:  # log
        return _log(x)
    elif OP == 7:  # sin
        return _sin(x)
    elif OP == 8:  # cos
        return _cos(x)
    elif OP == 9:  # tanh
        return _tanh(x)
    elif OP == 10:  # sigmoid
        return _sigmoid(x)
    elif OP == 11:  # relu
        return act_fwd(x, 1)
    elif OP == 12:  # gelu
        return act_fwd(x, 2)
    elif OP == 13:  # gelu_tanh
        return act_fwd(x, 3)
    elif OP == 14:  # silu
        return act_fwd(x, 4)
    elif OP == 15:  # reciprocal
        return _div(1.0, x)
    elif OP == 16:  # add
        return x + s
    elif OP == 17:  # mul
        return x * s
    elif OP == 18:  # pow
        return _pow(x, s)
    elif OP == 19:  # clamp_min, NaN-propagating
        return tl.where(x < s, s, x)
    else:  # clamp_max
        return tl.where(x > s, s, x)


@triton.jit
def unary_grad_step(g, x, OP: tl.constexpr, s):
    """g * d op / dx at x, following eager's backward formulas (as the C++ kernels do)."""
    if OP == NONE:
        return g
    elif OP == 0:
        return -g
    elif OP == 1:  # abs: sign, 0 at 0 (and at NaN)
        return g * ((x > 0.0).to(x.dtype) - (x < 0.0).to(x.dtype))
    elif OP == 2:
        return g * (2.0 * x)
    elif OP == 3:
        return g * (0.5 * _rsqrt(x))
    elif OP == 4:
        return g * (-0.5 * _rsqrt(x) * _div(1.0, x))
    elif OP == 5:
        return g * _exp(x)
    elif OP == 6:
        return g * _div(1.0, x)
    elif OP == 7:
        return g * _cos(x)
    elif OP == 8:
        return g * -_sin(x)
    elif OP == 9:
        return g * act_grad(x, 6)
    elif OP == 10:
        return g * act_grad(x, 5)
    elif OP == 11:
        return g * act_grad(x, 1)
    elif OP == 12:
        return g * act_grad(x, 2)
    elif OP == 13:
        return g * act_grad(x, 3)
    elif OP == 14:
        return g * act_grad(x, 4)
    elif OP == 15:
        r = _div(1.0, x)
        return g * -(r * r)
    elif OP == 16:
        return g
    elif OP == 17:
        return g * s
    elif OP == 18:  # pow: gradient exactly 0 for exponent 0, whatever g is
        return tl.where(s == 0.0, 0.0, g * (s * _pow(x, s - 1.0)))
    elif OP == 19:
        return g * tl.where(x >= s, 1.0, 0.0).to(x.dtype)
    else:
        return g * tl.where(s >= x, 1.0, 0.0).to(x.dtype)


# ---- dropout mask: Philox4x32-10 as in csrc/common/philox.h ----
@triton.jit
def _philox_words(group, seed):
    """The four uint32 words of counter (group lo, group hi, 0, 0) under key (seed lo, seed hi)."""
    g = group.to(tl.int64)
    c0 = (g & 0xFFFFFFFF).to(tl.uint32)
    c1 = (g >> 32).to(tl.uint32)
    zero = tl.zeros_like(c0)
    return tl.philox(seed, c0, c1, zero, zero)


@triton.jit
def keep_scale_block(start, BLOCK: tl.constexpr, seed, threshold, scale):
    """scale or 0 for the BLOCK elements from flat index `start` (a multiple of 4): one Philox call per 4
    elements, its words interleaved so element i takes word i % 4."""
    group = start // 4 + tl.arange(0, BLOCK // 4)
    r0, r1, r2, r3 = _philox_words(group, seed)
    words = tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), (BLOCK, ))
    return tl.where(words.to(tl.int64) >= threshold, scale, 0.0)


@triton.jit
def keep_scale_at(index, seed, threshold, scale):
    """scale or 0 for elements at arbitrary flat indices (any shape): one Philox call per element."""
    r0, r1, r2, r3 = _philox_words(index // 4, seed)
    w = index % 4
    words = tl.where(w == 0, r0, tl.where(w == 1, r1, tl.where(w == 2, r2, r3)))
    return tl.where(words.to(tl.int64) >= threshold, scale, 0.0)
