"""Device math of the Triton kernels, shared by every family: correctly rounded division and square root, the
transcendental functions, the activations and their derivatives, the unary_chain ops, and the Philox mask of
dropout. The formulas mirror csrc/common/pointwise_math.h and csrc/common/philox.h so that every backend computes
the same thing; activations and ops are chosen by name (a constexpr string: the names of csrc/common/op_codes.h).

On a GPU the transcendental functions come from libdevice (IEEE-accurate, unlike tl.exp / tl.sin, which lower to
the approximate PTX instructions), with subnormal results kept: every launch passes triton_utils.KEEP_SUBNORMALS.
Triton's interpreter cannot call libdevice, so under TRITON_INTERPRET=1 the same functions come from tl.math, with
tanh and pow (absent from tl.math) computed in float64. Divide with div and take roots with sqrt: correctly rounded,
as in eager (Triton's float32 `/` and tl.sqrt are not).
"""

import triton
import triton.language as tl
from triton.language.extra import libdevice

from fused.triton_utils import INTERPRET

# The op of an empty unary_chain slot.
NONE: tl.constexpr = tl.constexpr("none")


# ---- math primitives ----
@triton.jit
def neg(x):
    """-x with the sign of zero flipped too (-0 at +0), as eager's neg. Write neg(x), never `-x`, where x can be 0:
    Triton 3.6 (and earlier) lowers a float's unary minus to 0 - x, which is +0 at +0."""
    return x * -1.0


@triton.jit
def exp(x):
    if INTERPRET:
        return tl.exp(x)
    else:
        return libdevice.exp(x)


@triton.jit
def log(x):
    if INTERPRET:
        return tl.log(x)
    else:
        return libdevice.log(x)


@triton.jit
def expm1(x):
    """exp(x) - 1 without the cancellation near 0 (the interpreter, which lacks it: exp in float64 and - 1, exact
    enough for a float32 result)."""
    if INTERPRET:
        return (tl.exp(x.to(tl.float64)) - 1.0).to(x.dtype)
    else:
        return libdevice.expm1(x)


@triton.jit
def sin(x):
    if INTERPRET:
        return tl.sin(x)
    else:
        return libdevice.sin(x)


@triton.jit
def cos(x):
    if INTERPRET:
        return tl.cos(x)
    else:
        return libdevice.cos(x)


@triton.jit
def erf(x):
    return tl.math.erf(x)


@triton.jit
def sqrt(x):
    if x.dtype == tl.float64:
        return tl.sqrt(x)  # float64 sqrt is correctly rounded
    else:
        return tl.sqrt_rn(x)  # tl.sqrt for float32 is the approximate instruction


@triton.jit
def div(x, y):
    """x / y correctly rounded, as eager and the C++ kernels divide: Triton's `/` on float32 is div.full.f32
    (up to 2 ulp off). float64 `/` is already correctly rounded; 16-bit operands are divided in float32 and the
    quotient rounded back (24 bits are enough for that double rounding to be exact)."""
    q = x / y  # for its type only (Triton's promotion); dropped from the compiled kernel where unused
    if q.dtype == tl.float64:
        return q
    else:
        return tl.math.div_rn(tl.cast(x, tl.float32), tl.cast(y, tl.float32)).to(q.dtype)


@triton.jit
def rsqrt(x):
    return div(1.0, sqrt(x))  # like the C++ kernels (1 / sqrt), not the approximate rsqrt instruction


@triton.jit
def tanh(x):
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
def pow(x, s):
    if INTERPRET:
        # float64: |x|^s = exp2(s log2|x|); x with its sign bit set (-0 too): sign by parity for integer s, else NaN
        # but at -0 and -inf (C's pow)
        w = x.to(tl.float64)
        e = s.to(tl.float64)
        mag = tl.exp2(e * tl.log2(tl.abs(w)))
        is_int = tl.floor(e) == e
        odd = is_int & (tl.floor(e * 0.5) != e * 0.5)
        signed = tl.where(odd, neg(mag), mag)
        at_negative = tl.where(is_int, signed, tl.where((w == float("-inf")) | (w == 0.0), mag, float("nan")))
        y = tl.where(w.to(tl.int64, bitcast=True) < 0, at_negative, mag)  # sign bit: -0 too (pow(-0, 3) = -0)
        return tl.where(e == 0.0, 1.0, y).to(x.dtype)
    else:
        return libdevice.pow(x, s)


@triton.jit
def sigmoid(x):
    return div(1.0, 1.0 + exp(-x))


# ---- activations (ACT: a name of csrc/common/op_codes.h FUSED_ACTS) ----
@triton.jit
def act_fwd(x, ACT: tl.constexpr):
    if ACT == "identity":
        return x
    elif ACT == "relu":  # NaN-propagating like eager
        return tl.where(x < 0.0, 0.0, x)
    elif ACT == "gelu":  # erf
        return 0.5 * x * (1.0 + erf(x * 0.70710678118654752440))
    elif ACT == "gelu_tanh":
        inner = 0.79788456080286535588 * (x + 0.044715 * x * x * x)
        return 0.5 * x * (1.0 + tanh(inner))
    elif ACT == "silu":  # x / (1 + exp(-x)), as the C++ kernels and torch
        return div(x, 1.0 + exp(-x))
    elif ACT == "sigmoid":
        return sigmoid(x)
    else:
        tl.static_assert(ACT == "tanh", "act_fwd: unknown activation")
        return tanh(x)


@triton.jit
def act_grad(x, ACT: tl.constexpr):
    if ACT == "identity":
        return tl.full(x.shape, 1.0, x.dtype)
    elif ACT == "relu":
        return tl.where(x <= 0.0, 0.0, 1.0).to(x.dtype)  # NaN passes the gradient, as eager's threshold_backward
    elif ACT == "gelu":
        cdf = 0.5 * (1.0 + erf(x * 0.70710678118654752440))
        pdf = exp(-0.5 * x * x) * 0.39894228040143267794
        return cdf + x * pdf
    elif ACT == "gelu_tanh":
        x2 = x * x
        t = tanh(0.79788456080286535588 * (x + 0.044715 * x2 * x))
        dinner = 0.79788456080286535588 * (1.0 + (3 * 0.044715) * x2)
        return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * dinner
    elif ACT == "silu":
        s = sigmoid(x)
        return s * (1.0 + x * (1.0 - s))
    elif ACT == "sigmoid":
        s = sigmoid(x)
        return s * (1.0 - s)
    else:
        tl.static_assert(ACT == "tanh", "act_grad: unknown activation")
        t = tanh(x)
        return 1.0 - t * t


@triton.jit
def act_backward(g, x, ACT: tl.constexpr):
    """g * act'(x); relu passes or blocks g (a select, as eager's threshold_backward: an inf or NaN g where x <= 0
    gives 0, not NaN)."""
    if ACT == "relu":
        return tl.where(x <= 0.0, 0.0, g)
    else:
        return g * act_grad(x, ACT)


# ---- unary_chain ops (OP: a name of csrc/common/op_codes.h FUSED_CHAIN_OPS); s is the op's scalar in the math type
@triton.jit
def pow_op(x, s):
    """x^s as eager's pow(Tensor, Scalar): exponent 0.5 is sqrt there and -0.5 rsqrt (-0 and -inf differ from pow)."""
    if s == 0.5:
        y = sqrt(x)
    elif s == -0.5:
        y = rsqrt(x)
    else:
        y = pow(x, s)
    return y


@triton.jit
def unary_fwd(x, OP: tl.constexpr, s):
    if OP == NONE:
        return x
    elif OP == "neg":
        return neg(x)
    elif OP == "abs":
        return tl.abs(x)
    elif OP == "square":
        return x * x
    elif OP == "sqrt":
        return sqrt(x)
    elif OP == "rsqrt":
        return rsqrt(x)
    elif OP == "exp":
        return exp(x)
    elif OP == "log":
        return log(x)
    elif OP == "sin":
        return sin(x)
    elif OP == "cos":
        return cos(x)
    elif OP == "tanh" or OP == "sigmoid" or OP == "relu" or OP == "gelu" or OP == "gelu_tanh" or OP == "silu":
        return act_fwd(x, OP)  # the activation of the same name
    elif OP == "reciprocal":
        return div(1.0, x)
    elif OP == "add":
        return x + s
    elif OP == "mul":
        return x * s
    elif OP == "pow":
        return pow_op(x, s)
    elif OP == "clamp_min":  # NaN-propagating, in x and in the bound
        bound = tl.zeros_like(x) + s
        return tl.where((x < bound) | (bound != bound), bound, x)
    else:
        tl.static_assert(OP == "clamp_max", "unary_fwd: unknown op")
        bound = tl.zeros_like(x) + s
        return tl.where((x > bound) | (bound != bound), bound, x)


@triton.jit
def unary_grad_step(g, x, OP: tl.constexpr, s):
    """g * d op / dx at x, following eager's backward formulas (as the C++ kernels do)."""
    if OP == NONE:
        return g
    elif OP == "neg":
        return neg(g)
    elif OP == "abs":  # sign, 0 at 0 (and at NaN)
        return g * ((x > 0.0).to(x.dtype) - (x < 0.0).to(x.dtype))
    elif OP == "square":
        return g * (2.0 * x)
    elif OP == "sqrt":
        return g * (0.5 * rsqrt(x))
    elif OP == "rsqrt":  # -0.5 rsqrt(x)^3, as eager (+inf at -0)
        r = rsqrt(x)
        return g * (-0.5 * r * r * r)
    elif OP == "exp":
        return g * exp(x)
    elif OP == "log":
        return g * div(1.0, x)
    elif OP == "sin":
        return g * cos(x)
    elif OP == "cos":
        return g * neg(sin(x))
    elif OP == "tanh" or OP == "sigmoid" or OP == "relu" or OP == "gelu" or OP == "gelu_tanh" or OP == "silu":
        return act_backward(g, x, OP)
    elif OP == "reciprocal":
        r = div(1.0, x)
        return g * neg(r * r)
    elif OP == "add":
        return g
    elif OP == "mul":
        return g * s
    elif OP == "pow":  # gradient exactly 0 for exponent 0, whatever g is
        return tl.where(s == 0.0, 0.0, g * (s * pow_op(x, s - 1.0)))
    elif OP == "clamp_min":  # a select, as eager's
        return tl.where(x >= s, g, 0.0)
    else:
        tl.static_assert(OP == "clamp_max", "unary_grad_step: unknown op")
        return tl.where(s >= x, g, 0.0)


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
    words = tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), (BLOCK,))
    return tl.where(words.to(tl.int64) >= threshold, scale, 0.0)


@triton.jit
def keep_scale_at(index, seed, threshold, scale):
    """scale or 0 for elements at arbitrary flat indices (any shape): one Philox call per element."""
    r0, r1, r2, r3 = _philox_words(index // 4, seed)
    w = index % 4
    words = tl.where(w == 0, r0, tl.where(w == 1, r1, tl.where(w == 2, r2, r3)))
    return tl.where(words.to(tl.int64) >= threshold, scale, 0.0)
