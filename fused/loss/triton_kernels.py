"""Triton kernel of the loss family: fused::cross_entropy_rows, one program per row of logits. The formulas are
csrc/loss/loss_math.h's: the first pass reads the row once, keeping its running max m, sum of exp(z - m) and
smoothing sum relative to m (rescaled whenever m grows); the second pass, only when a gradient is asked for,
reads it again and writes the gradient. Math in float32 (float64 for float64 logits); exp, log, tanh and expm1
from libdevice on a GPU, divisions correctly rounded (fused/triton_math.py).

The launcher takes the op's own arguments and runs on CPU tensors under TRITON_INTERPRET=1 (how the tests check
it without a GPU)."""

import torch
import triton
import triton.language as tl

from fused import triton_math as tm
from fused.loss.ops import check_rows, check_target_range
from fused.loss.ops import math_dtype as math_torch_dtype
from fused.triton_utils import KEEP_SUBNORMALS, math_dtype, on_device_of, scalar_in, to_out

BLOCK = 4096  # columns per step of a row (fewer for a short row)


@triton.jit
def _capped(x, softcap, CAP: tl.constexpr):
    if CAP:
        return softcap * tm.tanh(tm.div(x, softcap))
    else:
        return x


@triton.jit
def row_start(x_ptr, ld, g_ptr, ldg, t_ptr, ignore_index, V, BLOCK: tl.constexpr):
    """This program's row: (row, x_row, g_row, cols0, ignored, t, bad). An out-of-range target t reads as 0 with bad
    set, and the row gets NaN (loss and gradient) instead of a read out of bounds; the launcher reports it on the
    CPU, a GPU goes on without a sync."""
    row = tl.program_id(0).to(tl.int64)
    t = tl.load(t_ptr + row)
    bad = (t < 0) | (t >= V)
    return row, x_ptr + row * ld, g_ptr + row * ldg, tl.arange(0, BLOCK), t == ignore_index, tl.where(bad, 0, t), bad


@triton.jit
def zero_row(g_row, V, cols0, MATH: tl.constexpr, BLOCK: tl.constexpr):
    """The gradient of an ignored row."""
    for start in range(0, V, BLOCK):
        cols = start + cols0
        tl.store(g_row + cols, tl.zeros((BLOCK,), MATH).to(g_row.dtype.element_ty), mask=cols < V)


@triton.jit
def ignored_row(out_a, out_b, g_row, V, cols0, GRAD: tl.constexpr, MATH: tl.constexpr, BLOCK: tl.constexpr):
    """An ignored row: its two outputs 0 and, when a gradient is asked for, its gradient zero."""
    tl.store(out_a, tl.zeros((), MATH))
    tl.store(out_b, tl.zeros((), MATH))
    if GRAD:
        zero_row(g_row, V, cols0, MATH, BLOCK)


@triton.jit
def _cross_entropy_rows_kernel(
    x_ptr,
    ld,
    g_ptr,
    ldg,
    t_ptr,
    w_ptr,
    w_sum_ptr,
    scale_ptr,
    scale_ld,
    loss_ptr,
    lse_ptr,
    V,
    ignore_index,
    label_smoothing: tl.float64,
    smooth_coef: tl.float64,
    z_loss: tl.float64,
    softcap: tl.float64,
    HAS_WEIGHT: tl.constexpr,
    SMOOTH: tl.constexpr,
    CAP: tl.constexpr,
    GRAD: tl.constexpr,
    MATH: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row, x_row, g_row, cols0, ignored, t, bad = row_start(x_ptr, ld, g_ptr, ldg, t_ptr, ignore_index, V, BLOCK)
    if ignored:
        ignored_row(loss_ptr + row, lse_ptr + row, g_row, V, cols0, GRAD, MATH, BLOCK)
        return
    ls = scalar_in(label_smoothing, MATH)
    weight_sum = tl.full((), V, MATH)
    if HAS_WEIGHT:
        weight_sum = tl.load(w_sum_ptr).to(MATH)
    eps = scalar_in(smooth_coef, MATH)
    cap = scalar_in(softcap, MATH)
    # pass 1: m, s = sum exp(z - m), sm = sum w (z - m); w_seen = sum of the weights read so far
    m = tl.full((), float("-inf"), MATH)
    s = tl.zeros((), MATH)
    sm = tl.zeros((), MATH)
    w_seen = tl.zeros((), MATH)
    for start in range(0, V, BLOCK):
        cols = start + cols0
        mask = cols < V
        z = tl.where(mask, _capped(tl.load(x_row + cols, mask=mask, other=0.0).to(MATH), cap, CAP), float("-inf"))
        m_new = tl.maximum(m, tl.max(z, axis=0))
        s = s * tl.where(m == m_new, 1.0, tm.exp(m - m_new)) + tl.sum(
            tl.where(z == float("-inf"), 0.0, tm.exp(z - m_new)), axis=0
        )
        if SMOOTH:
            w = tl.full((BLOCK,), 1.0, MATH)
            if HAS_WEIGHT:
                w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(MATH)
            w = tl.where(mask, w, 0.0)
            # rescaled to the new max only when it moved past something (m may still be -inf: nothing to rescale)
            shift = tl.where((w_seen == 0.0) | (m == m_new), 0.0, w_seen * (m - m_new))
            # a -inf logit makes the sum -inf (NaN at weight 0), as eager, whatever the running max
            term = tl.where(z == float("-inf"), w * z, w * (z - m_new))
            sm += shift + tl.sum(tl.where(mask, term, 0.0), axis=0)
            w_seen += tl.sum(w, axis=0)
        m = m_new
    log_s = tl.where(bad, float("nan"), tm.log(s))
    lse = m + log_s
    # a bad target's row reads nothing at t (V may be 0: no x[0] to read)
    z_t = _capped(tl.load(x_row + t, mask=~bad, other=float("nan")).to(MATH), cap, CAP)
    zt = z_t - m
    w_t = tl.full((), 1.0, MATH)
    if HAS_WEIGHT:
        w_t = tl.load(w_ptr + t, mask=~bad, other=1.0).to(MATH)
    loss = (1.0 - ls) * w_t * (log_s - zt)
    if SMOOTH:
        loss += eps * (weight_sum * log_s - sm)
    tl.store(loss_ptr + row, loss)
    tl.store(lse_ptr + row, lse)
    if GRAD:
        # The gradient may be written over the logits (linear_cross_entropy's buffer): no thread may store before
        # every thread has read z_t above.
        tl.debug_barrier()
        a = tl.load(scale_ptr + row * scale_ld).to(MATH)
        b = tl.load(scale_ptr + row * scale_ld + 1).to(MATH)
        coef_t = a * (1.0 - ls) * w_t
        coef_w = a * eps
        rest = coef_w * weight_sum + 2.0 * b * scalar_in(z_loss, MATH) * lse
        coef_p = coef_t + rest
        # the target's entry on its own: never from a rounded p_t (csrc/loss/loss_math.h)
        log_pt = zt - log_s
        g_t = coef_t * tm.expm1(log_pt) + rest * tm.exp(log_pt) - coef_w * w_t
        for start in range(0, V, BLOCK):
            cols = start + cols0
            mask = cols < V
            z = _capped(tl.load(x_row + cols, mask=mask, other=0.0).to(MATH), cap, CAP)
            g = coef_p * tm.exp((z - m) - log_s)
            if HAS_WEIGHT:
                g -= coef_w * tl.load(w_ptr + cols, mask=mask, other=0.0).to(MATH)
            else:
                g -= coef_w
            g = tl.where(cols == t, g_t, g)
            if CAP:
                u = tm.div(z, cap)
                g = g * (1.0 - u * u)
            tl.store(g_row + cols, to_out(g, g_ptr.dtype.element_ty), mask=mask)


def launch_rows(kernel, logits, grad, *args, **constexprs):
    """kernel, one program a row of logits (none when there are no rows), with the row kernels' first arguments
    (the logits and their row stride, the gradient, or the logits as a stand-in when none is asked for, and its row
    stride), then args, and with their launch keywords (GRAD, MATH, BLOCK, num_warps) after constexprs."""
    rows, V = logits.shape
    if rows == 0:
        return
    has_grad = grad.numel() > 0
    block = min(BLOCK, triton.next_power_of_2(max(V, 1)))
    kernel[(rows,)](
        logits,
        logits.stride(0),
        grad if has_grad else logits,
        grad.stride(0) if has_grad else 0,
        *args,
        **constexprs,
        GRAD=has_grad,
        MATH=math_dtype(logits),
        BLOCK=block,
        num_warps=8,
        **KEEP_SUBNORMALS,
    )


def row_outputs(op, logits, target, ignore_index):
    """The row kernels' common start: logits with unit column stride, two per-row outputs in the math dtype, and
    the target range checked where that needs no sync (CPU)."""
    rows, V = logits.shape
    if V > 1 and logits.stride(1) != 1:
        logits = logits.contiguous()
    acc = math_torch_dtype(logits)
    outputs = tuple(torch.empty(rows, dtype=acc, device=logits.device) for _ in range(2))
    if rows:
        check_target_range(op, target, V, ignore_index)
    return logits, outputs


@on_device_of
def cross_entropy_rows(logits, target, weight, scale, grad, ignore_index, label_smoothing, z_loss, softcap):
    """(loss, lse) per row, and the gradient into grad when it is not empty: fused::cross_entropy_rows."""
    check_rows("cross_entropy_rows", logits, target, weight, scale, grad, label_smoothing, softcap)
    logits, (loss, lse) = row_outputs("cross_entropy_rows", logits, target, ignore_index)
    V = logits.shape[1]
    launch_rows(
        _cross_entropy_rows_kernel,
        logits,
        grad,
        target.contiguous(),
        weight.contiguous() if weight is not None else loss,
        weight.double().sum() if weight is not None else loss,
        scale.contiguous(),
        2 if scale.dim() == 2 else 0,
        loss,
        lse,
        V,
        ignore_index,
        float(label_smoothing),
        float(label_smoothing) / max(V, 1),
        float(z_loss),
        float(softcap),
        HAS_WEIGHT=weight is not None,
        SMOOTH=label_smoothing != 0,
        CAP=softcap != 0,
    )
    return loss, lse
