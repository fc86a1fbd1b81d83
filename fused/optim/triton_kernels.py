"""Triton kernel of fused::adam_step_, and what the optimizer family's Triton kernels share (the gradient as an
update sees it, stochastic rounding of bf16 parameters; fused/optim/triton_norm.py, triton_sgd.py and
triton_accumulate.py hold the other ops). One launch per combination of dtypes covers all tensors of a step
(fused/optim/triton_lists.py), with the CPU kernel's formulas (csrc/optim/optim_cpu.cpp) and its fmas, so its bits
from the same inputs.

Every tensor is walked in flat memory order as [ROWS, 256] tiles, so with 8-bit state (state_dtype="int8") a tile
row is one quantization block: its codes are decoded, updated and re-encoded in registers with
csrc/optim/quantize_cpu.h's arithmetic (the block's scale a row max). The device scalars (clip coefficient, loss
scale, found_inf) are read by the kernel: a step skipped on found_inf stores nothing, and nothing syncs with the
host. On a GPU each program computes its tensor's bias corrections in float64 from its step counter (libdevice's
pow, CUDA's: what the CUDA C++ kernel uses), and the last program of a launch advances the group's counters
(triton_lists.advance_steps), so a step is its launches and nothing else. Under the interpreter the corrections come
from the host (the C library's pow, as the CPU kernel: the interpreter's pow is not that one)."""

import math

import torch
import triton
import triton.language as tl

from fused.optim.triton_lists import (
    TL_DTYPES,
    advance_steps,
    groups,
    list_ptr,
    per_tensor,
    program_tensor,
    step_ticket,
    tl_dtype,
)
from fused.triton_math import div, neg, pow, sqrt
from fused.triton_utils import KEEP_SUBNORMALS, scalar_in, to_out

QBLOCK = 256  # fused.optim.quantize.BLOCK: one tile row
ROWS = 4  # tile rows a program
FLT_MAX = tl.constexpr(3.4028234663852886e38)
# stochastic rounding keys (csrc/optim/rounding_keys.h) in int64 arithmetic: tensor t's parameter seed + t * 0x9E37...,
# its k-th moment state_seed + t * 0x9E37... + k * 0xD1B5... (mod 2^64)
TENSOR_KEY_STEP_I64 = tl.constexpr(0x9E3779B97F4A7C15 - 2**64)


def _int64_bits(x):
    x %= 2**64
    return x - 2**64 if x >= 2**63 else x


# dither_word's constants (csrc/optim/rounding_keys.h)
DITHER_HIGH_STEP, DITHER_MUL_1, DITHER_MUL_2 = (tl.constexpr(k) for k in (0x9E3779B9, 0x7FEB352D, 0x846CA68B))
EXP_AVG_KEY, EXP_AVG_SQ_KEY, MAX_EXP_AVG_SQ_KEY = (tl.constexpr(_int64_bits(k * 0xD1B54A32D192ED03)) for k in (1, 2, 3))


@triton.jit
def _rne_small(x):
    """x (0 <= x < 2^22, float32) rounded to the nearest integer, ties to even: the float32 add rounds it."""
    return (x + 8388608.0) - 8388608.0


@triton.jit
def _decode(q_ptr, scale_ptr, offs, rows, mask, row_mask, SIGNED: tl.constexpr):
    """The float32 values of the codes at offs (a [ROWS, 256] tile, one block a row) with their blocks' scales."""
    levels: tl.constexpr = 127.0 if SIGNED else 255.0
    c = tl.load(q_ptr + offs, mask=mask, other=0).to(tl.float32)
    s = div(tl.load(scale_ptr + rows, mask=row_mask, other=0.0), levels * levels)[:, None]
    if SIGNED:
        return c * tl.abs(c) * s
    else:
        w = c * c * s
        return w * w


@triton.jit
def _dither_word(key, j):
    """csrc/optim/rounding_keys.h's dither_word: the hash of word j (int64, per element) under key (int64 bits)."""
    key_lo = (key & 0xFFFFFFFF).to(tl.uint32)
    key_hi = ((key >> 32) & 0xFFFFFFFF).to(tl.uint32)
    x = (j & 0xFFFFFFFF).to(tl.uint32) + (key_lo + ((j >> 32) & 0xFFFFFFFF).to(tl.uint32) * DITHER_HIGH_STEP)
    x = (x ^ (x >> 16)) * DITHER_MUL_1
    x = (x ^ (x >> 15) ^ key_hi) * DITHER_MUL_2
    return x ^ (x >> 16)


@triton.jit
def _dither_half(key, offs):
    """The 16 dither bits of elements offs: half i % 2 of _dither_word(key, i / 2), the high half for even i."""
    word = _dither_word(key, offs // 2)
    return tl.where(offs % 2 == 0, word >> 16, word & 0xFFFF)


@triton.jit
def _dithered_code(t, d):
    """csrc/optim/quantize_cpu.h's dithered_code: t's uint8 code, rounded up with the probability that keeps the
    decoded v unbiased (to nearest below 1); the same steps (tl.fma where it takes fmas)."""
    c = tl.floor(t)
    c2 = c * c
    c4 = c2 * c2
    nxt = c + 1.0
    nxt2 = nxt * nxt
    t2 = t * t
    gap = tl.fma(nxt2, nxt2, -c4)
    above = tl.fma(t2, t2, -c4)
    dither = tl.where(c == 0.0, 0.0625, d)
    return tl.where(dither * gap < above, nxt, c)


@triton.jit
def _encode(x, q_ptr, scale_ptr, offs, rows, mask, row_mask, SIGNED: tl.constexpr, key, DITHER: tl.constexpr):
    """Stores x's codes and each row's scale (its max |x|, or max sqrt(x) unsigned; NaN if any is NaN). DITHER
    (unsigned only): rounded stochastically with _dither_half's bits."""
    levels: tl.constexpr = 127.0 if SIGNED else 255.0
    if SIGNED:
        mag = tl.abs(x)
    else:
        mag = sqrt(x)
    mag = tl.where(mask, mag, 0.0)
    nan = mag != mag
    has_nan = tl.max(nan.to(tl.int32), axis=1) > 0
    a = tl.where(has_nan, float("nan"), tl.max(tl.where(nan, 0.0, mag), axis=1))
    tl.store(scale_ptr + rows, a, mask=row_mask)
    usable = (a > 0.0) & (a <= FLT_MAX)  # else codes 0: zero blocks decode to 0, non-finite ones to NaN
    inv = div(tl.full(a.shape, 1.0, tl.float32), a)
    # mag / a as mag * (1 / a), but for a denormal a, whose inverse overflows
    ratio = tl.where((inv <= FLT_MAX)[:, None], mag * inv[:, None], div(mag, a[:, None]))
    t = sqrt(ratio) * levels
    if DITHER:
        q = _dithered_code(t, (2 * _dither_half(key, offs) + 1).to(tl.float32) * 7.62939453125e-06)  # (2 h + 1) / 2^17
    else:
        q = _rne_small(t)
    q = tl.where(usable[:, None], q, 0.0)
    if SIGNED:
        tl.store(q_ptr + offs, tl.where(x < 0.0, -q, q).to(tl.int8), mask=mask)
    else:
        tl.store(q_ptr + offs, q.to(tl.uint8), mask=mask)


@triton.jit
def _load_state(ptr, scale_ptr, offs, rows, mask, row_mask, MATH: tl.constexpr, CODES: tl.constexpr,
                SIGNED: tl.constexpr):  # fmt: skip
    if CODES:
        return _decode(ptr, scale_ptr, offs, rows, mask, row_mask, SIGNED)
    else:
        return tl.load(ptr + offs, mask=mask, other=0.0).to(MATH)


@triton.jit
def _philox_word(key, counter, w):
    """Word w (0..3, per element) of Philox4x32-10 at counter (per element, int64) under key."""
    zero = tl.zeros_like(counter).to(tl.uint32)
    lo, hi = (counter & 0xFFFFFFFF).to(tl.uint32), (counter >> 32).to(tl.uint32)
    r0, r1, r2, r3 = tl.philox(key, lo, hi, zero, zero)
    return tl.where(w == 0, r0, tl.where(w == 1, r1, tl.where(w == 2, r2, r3)))


@triton.jit
def _store_bf16_rounded_up(x, ptr, offs, mask, addend):
    """x (float32) stored as bf16 after adding addend (< 2^16) below its mantissa and truncating: stochastic
    rounding for a uniform addend; NaN stays NaN, inf stays inf."""
    bits = tl.where(x != x, 0x7FC00000, x.to(tl.uint32, bitcast=True) + addend)
    tl.store(ptr + offs, (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)


@triton.jit
def _store_state(x, ptr, scale_ptr, offs, rows, mask, row_mask, key, CODES: tl.constexpr, SIGNED: tl.constexpr,
                 STOCHASTIC: tl.constexpr, DITHER: tl.constexpr = False):  # fmt: skip
    """8-bit codes (DITHER: rounded stochastically, see _encode), or bf16 moments stochastically (_dither_half's
    addends, the CPU kernel's), or rounded to nearest even."""
    if CODES:
        _encode(x, ptr, scale_ptr, offs, rows, mask, row_mask, SIGNED, key, DITHER)
    elif STOCHASTIC:
        _store_bf16_rounded_up(x, ptr, offs, mask, _dither_half(key, offs))
    else:
        tl.store(ptr + offs, to_out(x, ptr.dtype.element_ty), mask=mask)


@triton.jit
def store_param(p, ptr, offs, mask, key, STOCHASTIC: tl.constexpr):
    """bf16 stochastically (element i: the top 16 bits of Philox word i % 4 of counter i / 4 under key), else
    rounded to nearest even."""
    if STOCHASTIC:
        _store_bf16_rounded_up(p, ptr, offs, mask, _philox_word(key, offs // 4, offs % 4) >> 16)
    else:
        tl.store(ptr + offs, to_out(p, ptr.dtype.element_ty), mask=mask)


@triton.jit
def inverse_scale(scale_ptr, HAS_SCALE: tl.constexpr):
    """1 / grad_scale as float32, the reciprocal taken in double as torch's GradScaler (1 without a scale)."""
    if HAS_SCALE:
        return (1.0 / tl.load(scale_ptr).to(tl.float64)).to(tl.float32)
    else:
        return tl.full((), 1.0, tl.float32)


@triton.jit
def clip_value_of(g, clip_value, MATH: tl.constexpr):
    """g clamped to [-clip_value, clip_value]; NaN stays NaN."""
    cv = scalar_in(clip_value, MATH)
    return tl.where(g < -cv, -cv, tl.where(g > cv, cv, g))


@triton.jit
def update_grad(g_ptr, offs, mask, end, coef_ptr, scale_ptr, clip_value, MATH: tl.constexpr, HAS_SCALE: tl.constexpr,
                CLIP: tl.constexpr, WRITE_GRADS: tl.constexpr):  # fmt: skip
    """The gradient as an update sees it before maximize: unscaled, value-clipped, times the clip coefficient (the
    CPU kernel's GradTransform::clipped); under WRITE_GRADS stored back where the step changes it (a loss scale,
    value or norm clipping). mask: the elements of this program the step updates (none when it is skipped), end:
    its element count (0 when skipped)."""
    inv = inverse_scale(scale_ptr, HAS_SCALE)
    coef = tl.load(coef_ptr)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(MATH) * inv.to(MATH)
    if CLIP:
        g = clip_value_of(g, clip_value, MATH)
    g = g * coef.to(MATH)
    if WRITE_GRADS:
        if CLIP:
            tl.store(g_ptr + offs, to_out(g, g_ptr.dtype.element_ty), mask=mask)
        else:
            changed = tl.where(inv != 1.0, end, tl.where(coef != 1.0, end, 0))
            tl.store(g_ptr + offs, to_out(g, g_ptr.dtype.element_ty), mask=offs < changed)
    return g


@triton.jit
def update_end(found_ptr, numel):
    """The elements an update of a tensor of numel elements writes: all, or none when found_inf is set (the whole
    step skipped)."""
    return tl.where(tl.load(found_ptr) == 0.0, numel, 0)


@triton.jit
def tensor_key(seed, t):
    """Tensor t's stochastic-rounding key, seed + t * golden (mod 2^64, as int64 bits)."""
    return seed + t * TENSOR_KEY_STEP_I64


@triton.jit
def _state_key(seed, t, moment: tl.constexpr):
    """The key of one of tensor t's moments (moment: EXP_AVG_KEY, EXP_AVG_SQ_KEY or MAX_EXP_AVG_SQ_KEY)."""
    return tensor_key(seed, t) + moment


@triton.jit
def bias_terms(h, step_ptr, lr, beta1, beta2, TERMS: tl.constexpr):
    """-lr / (1 - beta1^step) and 1 / sqrt(1 - beta2^step) (float64) for this step: columns 5 and 6 of the tensor's
    row h where the host computed them (TERMS == 7), else from its step counter as the CUDA C++ kernel does."""
    if TERMS == 7:
        return tl.load(h + 5), tl.load(h + 6)
    else:
        step = tl.load(step_ptr).to(tl.float64) + 1.0
        return neg(lr / (1.0 - pow(beta1, step))), 1.0 / sqrt(1.0 - pow(beta2, step))


@triton.jit(do_not_specialize=["n", "seed", "state_seed"])
def _adam_kernel(
    table, tensor_of, n, terms_ptr, coef_ptr, scale_ptr, found_ptr, ticket_ptr, seed, state_seed,
    clip_value: tl.float64, P: tl.constexpr, G: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr,
    MODEL: tl.constexpr, AMSGRAD: tl.constexpr, DECOUPLED: tl.constexpr, MAXIMIZE: tl.constexpr,
    CODES: tl.constexpr, HAS_SCALE: tl.constexpr, CLIP: tl.constexpr, STOCHASTIC: tl.constexpr,
    STATE_STOCHASTIC: tl.constexpr, DITHER: tl.constexpr, MASTER: tl.constexpr, WRITE_GRADS: tl.constexpr,
    MATH: tl.constexpr, ROWS: tl.constexpr, TERMS: tl.constexpr,
):  # fmt: skip
    """One tile of ROWS x 256 elements of one tensor of the group (table: the lists params, grads, exp_avgs,
    exp_avg_sqs, max_exp_avg_sqs, their three scale lists, model_params, steps); S1, S2: the dtypes of exp_avg and
    of exp_avg_sq / max_exp_avg_sq. STATE_STOCHASTIC: bf16 moments rounded stochastically; DITHER: exp_avg_sq's
    8-bit codes. terms_ptr: TERMS float64 a tensor (bias_terms)."""
    i, tile, numel, t = program_tensor(table, tensor_of, n, 10)
    rows = tile * ROWS + tl.arange(0, ROWS)
    offs = rows[:, None] * 256 + tl.arange(0, 256)[None, :]
    end = update_end(found_ptr, numel)
    mask = offs < end
    row_mask = rows * 256 < end
    p_ptr = list_ptr(table, n, i, 0, P)
    m_ptr, v_ptr, x_ptr = list_ptr(table, n, i, 2, S1), list_ptr(table, n, i, 3, S2), list_ptr(table, n, i, 4, S2)
    ms_ptr, vs_ptr = list_ptr(table, n, i, 5, tl.float32), list_ptr(table, n, i, 6, tl.float32)
    xs_ptr = list_ptr(table, n, i, 7, tl.float32)
    h = terms_ptr + t * TERMS  # lr, beta1, beta2, eps, weight_decay (and bias_terms' two)
    lr, beta1, beta2, eps, wd = tl.load(h), tl.load(h + 1), tl.load(h + 2), tl.load(h + 3), tl.load(h + 4)
    neg_step, inv_bc2 = bias_terms(h, list_ptr(table, n, i, 9, tl.float32), lr, beta1, beta2, TERMS)
    neg_step, inv_bc2 = neg_step.to(MATH), inv_bc2.to(MATH)
    p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(MATH)
    g = update_grad(list_ptr(table, n, i, 1, G), offs, mask, end, coef_ptr, scale_ptr, clip_value, MATH, HAS_SCALE,
                    CLIP, WRITE_GRADS)  # fmt: skip
    if MAXIMIZE:
        g = 0.0 - g  # the CPU kernel's 0 - g: a zero gradient stays +0
    if DECOUPLED:
        p = p * (1.0 - lr * wd).to(MATH)
    else:
        g = tl.where(wd != 0.0, tl.fma(p, wd.to(MATH), g), g)
    m = _load_state(m_ptr, ms_ptr, offs, rows, mask, row_mask, MATH, CODES, True)
    v = _load_state(v_ptr, vs_ptr, offs, rows, mask, row_mask, MATH, CODES, False)
    m = tl.fma(g - m, (1.0 - beta1).to(MATH), m)
    v = tl.fma(g * g, (1.0 - beta2).to(MATH), v * beta2.to(MATH))
    m_key, v_key = _state_key(state_seed, t, EXP_AVG_KEY), _state_key(state_seed, t, EXP_AVG_SQ_KEY)
    _store_state(m, m_ptr, ms_ptr, offs, rows, mask, row_mask, m_key, CODES, True, STATE_STOCHASTIC)
    _store_state(v, v_ptr, vs_ptr, offs, rows, mask, row_mask, v_key, CODES, False, STATE_STOCHASTIC, DITHER)
    if AMSGRAD:
        x = _load_state(x_ptr, xs_ptr, offs, rows, mask, row_mask, MATH, CODES, False)
        v = tl.where(x > v, x, v)
        x_key = _state_key(state_seed, t, MAX_EXP_AVG_SQ_KEY)
        _store_state(v, x_ptr, xs_ptr, offs, rows, mask, row_mask, x_key, CODES, False, STATE_STOCHASTIC)
    denom = tl.fma(sqrt(v), inv_bc2, eps.to(MATH))
    p = tl.fma(neg_step, div(m, denom), p)
    store_param(p, p_ptr, offs, mask, tensor_key(seed, t), STOCHASTIC)
    if MASTER:
        model_ptr = list_ptr(table, n, i, 8, MODEL)
        tl.store(model_ptr + offs, to_out(p, model_ptr.dtype.element_ty), mask=mask)
    advance_steps(ticket_ptr, table, n, 9, found_ptr)


def host_terms(device):
    """Whether the launch takes the bias corrections from the host: under the interpreter (a CPU device)."""
    return device.type == "cpu"


def _tensor_terms(steps, rows, device):
    """Per tensor its hyperparameters (lr, beta1, beta2, eps, weight_decay), float64 [n, 5] on the device (cached:
    copied once), and under host_terms (-lr / (1 - beta1^step), 1 / sqrt(1 - beta2^step)) too, [n, 7], from the
    step counters by the C library's pow, as the CPU kernel."""
    if not host_terms(device):
        return per_tensor(rows, device)
    terms = []
    for s, (lr, beta1, beta2, eps, wd) in zip(steps, rows):
        step = float(s) + 1.0
        bias = [-(lr / (1.0 - math.pow(beta1, step))), 1.0 / math.sqrt(1.0 - math.pow(beta2, step))]
        terms.append([lr, beta1, beta2, eps, wd, *bias])
    return torch.tensor(terms, dtype=torch.float64, device=device)


def advance_empty_steps(grps, steps, found_inf):
    """The step counters of groups that take no program (only empty tensors): no kernel advances them."""
    idle = [steps[t] for g in grps if not g.programs for t in g.indices]
    if idle:
        torch._foreach_add_(idle, (found_inf == 0).to(torch.float32))  # a skipped step does not count


def seed_of(sr_seed):
    """The stochastic-rounding seed as int64 bits (an int64 CPU scalar: no device sync), or None."""
    if sr_seed is None:
        return None
    seed = int(sr_seed.item()) % 2**64
    return seed - 2**64 if seed >= 2**63 else seed


def adam_step_(
    params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr, beta1, beta2, eps, weight_decay, amsgrad,
    decoupled, maximize, clip_coef, grad_scale, found_inf, clip_value, model_params, sr_seed=None, hyper=None,
    write_grads=False, exp_avg_scales=None, exp_avg_sq_scales=None, max_exp_avg_sq_scales=None, state_seed=None,
):  # fmt: skip
    """fused::adam_step_ on Triton: the op's arguments (csrc/optim/optim_schema.cpp); the CPU kernel's checks of
    the lists are not repeated here (the optimizers build them). One launch per combination of dtypes."""
    if clip_value < 0:
        raise RuntimeError(f"fused.adam_step_: clip_value must be >= 0, got {clip_value}")
    if not params:
        return
    with torch.cuda.device_of(params[0]):
        n = len(params)
        rows = hyper.tolist() if hyper is not None else [[lr, beta1, beta2, eps, weight_decay]] * n
        terms = _tensor_terms(steps, rows, params[0].device)
        seed, state_key = seed_of(sr_seed), seed_of(state_seed)
        scale_lists = [exp_avg_scales, exp_avg_sq_scales, max_exp_avg_sq_scales if amsgrad else None]
        lists = [params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs if amsgrad else None, *scale_lists]
        grps = groups([*lists, model_params or None, steps], ROWS * QBLOCK, keep_empty=True)
        for grp in grps:
            if not grp.programs:
                continue
            p_t, g_t, m_t, v_t = grp.dtypes[:4]
            _adam_kernel[(grp.programs,)](
                grp.table, grp.tensor_of, len(grp.indices), terms, clip_coef,
                grad_scale if grad_scale is not None else found_inf, found_inf,
                step_ticket(params[0].device), 0 if seed is None else seed,
                0 if state_key is None else state_key, float(clip_value),
                P=TL_DTYPES[p_t], G=TL_DTYPES[g_t], S1=TL_DTYPES[m_t], S2=TL_DTYPES[v_t],
                MODEL=tl_dtype(grp.dtypes[8], p_t), AMSGRAD=bool(amsgrad), DECOUPLED=bool(decoupled),
                MAXIMIZE=bool(maximize), CODES=m_t == torch.int8, HAS_SCALE=grad_scale is not None,
                CLIP=not math.isinf(clip_value), STOCHASTIC=seed is not None and p_t == torch.bfloat16,
                STATE_STOCHASTIC=state_key is not None and m_t == torch.bfloat16,
                DITHER=state_key is not None and m_t == torch.int8, MASTER=bool(model_params),
                WRITE_GRADS=bool(write_grads),
                MATH=tl.float64 if p_t == torch.float64 else tl.float32, ROWS=ROWS, TERMS=terms.shape[1],
                enable_fp_fusion=False,  # only the CPU kernel's fmas (tl.fma): no other product left unrounded
                **KEEP_SUBNORMALS,
            )  # fmt: skip
        advance_empty_steps(grps, steps, found_inf)
