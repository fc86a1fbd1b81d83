"""Triton kernels of the log-prob and distillation row ops (fused::log_prob_rows, fused::distillation_rows), one
program per row, with csrc/loss/logprob_math.h's formulas. The first pass reads the row once, keeping a running max
m, sum of exp(z - m) and (log-probs) sum of exp(z - m) (z - m), rescaled whenever m grows; the later passes read it
again (distillation: the loss's sums; then the gradient, only when one is asked for). Math in float32 (float64 for
float64 logits); exp, log and expm1 from libdevice on a GPU, divisions correctly rounded (fused/triton_math.py).

The launchers take the ops' own arguments and run on CPU tensors under TRITON_INTERPRET=1."""

import torch
import triton
import triton.language as tl

from fused import triton_math as tm
from fused.loss.chunked import math_dtype as math_torch_dtype
from fused.loss.distillation import DIVERGENCES, check_distillation_rows
from fused.loss.log_probs import check_log_prob_rows
from fused.loss.triton_kernels import ignored_row, launch_rows, row_outputs, row_start, zero_row
from fused.triton_utils import on_device_of, scalar_in, to_out


@triton.jit
def _weight_mul(w, d):
    """w * d, 0 where the weight w is 0: a masked (-inf) logit's p log p is 0 (logprob_math.h's p_weight_mul)."""
    return tl.where(w == 0, 0.0, w * d)


@triton.jit
def _row_stats(x_row, V, inv_t, cols0, MATH: tl.constexpr, BLOCK: tl.constexpr):
    """(m, s, sez) of z = x / temperature: max, sum exp(z - m), sum exp(z - m) (z - m)."""
    m = tl.full((), float("-inf"), MATH)
    s = tl.zeros((), MATH)
    sez = tl.zeros((), MATH)
    for start in range(0, V, BLOCK):
        cols = start + cols0
        mask = cols < V
        z = tl.where(mask, tl.load(x_row + cols, mask=mask, other=0.0).to(MATH) * inv_t, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, axis=0))
        alpha = tl.where(m == m_new, 1.0, tm.exp(m - m_new))
        # (z - m) = (z - m_new) - shift for what was summed so far (nothing while m is -inf)
        shift = tl.where((m == m_new) | (m == float("-inf")), 0.0, m - m_new)
        sez = alpha * (sez + shift * s)
        s = s * alpha
        e = tl.where(mask & (z > float("-inf")), tm.exp(z - m_new), 0.0)  # a -inf logit adds nothing
        s += tl.sum(e, axis=0)
        sez += tl.sum(tl.where(mask, _weight_mul(e, z - m_new), 0.0), axis=0)
        m = m_new
    return m, s, sez


@triton.jit
def _log_prob_rows_kernel(
    x_ptr,
    ld,
    g_ptr,
    ldg,
    t_ptr,
    scale_ptr,
    logp_ptr,
    entropy_ptr,
    V,
    ignore_index,
    temperature: tl.float64,
    GRAD: tl.constexpr,
    MATH: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row, x_row, g_row, cols0, ignored, t, bad = row_start(x_ptr, ld, g_ptr, ldg, t_ptr, ignore_index, V, BLOCK)
    if ignored:
        ignored_row(logp_ptr + row, entropy_ptr + row, g_row, V, cols0, GRAD, MATH, BLOCK)
        return
    temp = scalar_in(temperature, MATH)
    inv_t = tm.div(tl.full((), 1.0, MATH), temp)
    m, s, sez = _row_stats(x_row, V, inv_t, cols0, MATH, BLOCK)
    log_s = tl.where(bad, float("nan"), tm.log(s))
    entropy = log_s - tm.div(sez, s)
    logp_t = (tl.load(x_row + t).to(MATH) * inv_t - m) - log_s
    tl.store(logp_ptr + row, logp_t)
    tl.store(entropy_ptr + row, entropy)
    if GRAD:
        g_l = tm.div(tl.load(scale_ptr + 2 * row).to(MATH), temp)
        g_h = tm.div(tl.load(scale_ptr + 2 * row + 1).to(MATH), temp)
        # the target's entry from expm1(log p_t): exact for a confident prediction
        g_t = tm.neg(g_l) * tm.expm1(logp_t) - g_h * tm.exp(logp_t) * (logp_t + entropy)
        for start in range(0, V, BLOCK):
            cols = start + cols0
            mask = cols < V
            lp = (tl.load(x_row + cols, mask=mask, other=0.0).to(MATH) * inv_t - m) - log_s
            g = tm.neg(_weight_mul(tm.exp(lp), g_l + g_h * (lp + entropy)))
            g = tl.where(cols == t, g_t, g)
            tl.store(g_row + cols, to_out(g, g_ptr.dtype.element_ty), mask=mask)


@on_device_of
def log_prob_rows(logits, target, scale, grad, ignore_index, temperature):
    """(logp, entropy) per row, and the gradient into grad when it is not empty: fused::log_prob_rows."""
    check_log_prob_rows("log_prob_rows", logits, target, scale, grad, temperature)
    logits, (logp, entropy) = row_outputs("log_prob_rows", logits, target, ignore_index)
    launch_rows(
        _log_prob_rows_kernel,
        logits,
        grad,
        target.contiguous(),
        scale.contiguous(),
        logp,
        entropy,
        logits.shape[1],
        ignore_index,
        float(temperature),
    )
    return logp, entropy


@triton.jit
def _point(ls, lt, log_beta, log_1mb, DIV: tl.constexpr):
    """The reference point x of the sums (logprob_math.h's divergence_point)."""
    if DIV == 0:
        return ls
    elif DIV == 1:
        return lt
    else:
        a = lt + log_beta
        b = ls + log_1mb
        hi = tl.maximum(a, b)
        return tl.where(hi == float("-inf"), hi, hi + tm.log(1.0 + tm.exp(-tl.abs(a - b))))  # both -inf: -inf


@triton.jit
def _distillation_rows_kernel(
    x_ptr,
    ld,
    g_ptr,
    ldg,
    y_ptr,
    ldt,
    t_ptr,
    scale_ptr,
    scale_step,
    loss_ptr,
    V,
    ignore_index,
    beta: tl.float64,
    log_beta: tl.float64,
    log_1mb: tl.float64,
    temperature: tl.float64,
    HAS_TARGET: tl.constexpr,
    TRIVIAL: tl.constexpr,
    DIV: tl.constexpr,
    GRAD: tl.constexpr,
    MATH: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * ld
    y_row = y_ptr + row * ldt
    g_row = g_ptr + row * ldg
    cols0 = tl.arange(0, BLOCK)
    skip = TRIVIAL
    if HAS_TARGET:
        skip = skip | (tl.load(t_ptr + row) == ignore_index)
    if skip:
        tl.store(loss_ptr + row, tl.zeros((), MATH))
        if GRAD:
            zero_row(g_row, V, cols0, MATH, BLOCK)
        return
    temp = scalar_in(temperature, MATH)
    inv_t = tm.div(tl.full((), 1.0, MATH), temp)
    b = scalar_in(beta, MATH)
    lb = scalar_in(log_beta, MATH)
    l1b = scalar_in(log_1mb, MATH)
    m_s, s_s, _ = _row_stats(x_row, V, inv_t, cols0, MATH, BLOCK)
    m_t, s_t, _ = _row_stats(y_row, V, inv_t, cols0, MATH, BLOCK)
    # log p = (z - m) - log_s, as the CPU kernel's log_softmax: z - (m + log_s) would put the ulp of a large m into p
    log_ss = tm.log(s_s)
    log_st = tm.log(s_t)
    sum_t = tl.zeros((), MATH)
    sum_s = tl.zeros((), MATH)
    for start in range(0, V, BLOCK):
        cols = start + cols0
        mask = cols < V
        ls = (tl.load(x_row + cols, mask=mask, other=0.0).to(MATH) * inv_t - m_s) - log_ss
        lt = (tl.load(y_row + cols, mask=mask, other=0.0).to(MATH) * inv_t - m_t) - log_st
        x = _point(ls, lt, lb, l1b, DIV)
        sum_t += tl.sum(tl.where(mask, _weight_mul(tm.exp(lt), lt - x), 0.0), axis=0)
        sum_s += tl.sum(tl.where(mask, _weight_mul(tm.exp(ls), ls - x), 0.0), axis=0)
    if DIV == 0:
        loss = sum_t
    elif DIV == 1:
        loss = sum_s
    else:
        loss = b * sum_t + (1.0 - b) * sum_s
    tl.store(loss_ptr + row, loss)
    if GRAD:
        coef = tm.div(tl.load(scale_ptr + row * scale_step).to(MATH), temp)
        for start in range(0, V, BLOCK):
            cols = start + cols0
            mask = cols < V
            ls = (tl.load(x_row + cols, mask=mask, other=0.0).to(MATH) * inv_t - m_s) - log_ss
            lt = (tl.load(y_row + cols, mask=mask, other=0.0).to(MATH) * inv_t - m_t) - log_st
            if DIV == 0:
                g = tm.exp(ls) - tm.exp(lt)
            elif DIV == 1:
                g = _weight_mul(tm.exp(ls), ls - lt - sum_s)
            else:
                g = (1.0 - b) * _weight_mul(tm.exp(ls), ls - _point(ls, lt, lb, l1b, DIV) - sum_s)
            tl.store(g_row + cols, to_out(coef * g, g_ptr.dtype.element_ty), mask=mask)


@on_device_of
def distillation_rows(logits, teacher_logits, target, scale, grad, divergence, beta, temperature, ignore_index):
    """The divergence per row, and the student's gradient into grad when it is not empty: fused::distillation_rows."""
    check_distillation_rows(
        "distillation_rows", logits, teacher_logits, target, scale, grad, divergence, beta, temperature
    )
    rows, V = logits.shape
    logits, teacher_logits = (t.contiguous() if V > 1 and t.stride(1) != 1 else t for t in (logits, teacher_logits))
    loss = torch.empty(rows, dtype=math_torch_dtype(logits), device=logits.device)
    div = DIVERGENCES.index(divergence)
    log_beta = float(torch.tensor(beta, dtype=torch.float64).log())
    log_1mb = float(torch.tensor(-beta, dtype=torch.float64).log1p())
    launch_rows(
        _distillation_rows_kernel,
        logits,
        grad,
        teacher_logits,
        teacher_logits.stride(0),
        target.contiguous() if target is not None else loss,
        scale.contiguous(),
        1 if scale.dim() == 1 else 0,
        loss,
        V,
        ignore_index,
        float(beta),
        max(log_beta, -1e300),
        max(log_1mb, -1e300),
        float(temperature),
        HAS_TARGET=target is not None,
        TRIVIAL=div == 2 and beta in (0.0, 1.0),
        DIV=div,
    )
    return loss
