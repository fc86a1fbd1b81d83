"""Triton kernels of the norm family, with launchers that take norm_fwd's and norm_backward's arguments
(csrc/norm/norm_schema.cpp) and return what those ops return. fused/norm/ops.py routes CUDA tensors here; under
TRITON_INTERPRET=1 the launchers also run on CPU tensors (that is how the tests check them).

One program holds a whole row (BLOCK_C = the next power of two >= C, up to MAX_C): the forward takes one row per
program, the backward one chunk of rows per program, its weight / bias gradient partial sums in registers and then
in a fixed slot of a [chunks, C] buffer that a torch sum reduces in a fixed order (no atomics: the same bits every
run). Statistics in float32 (float64 for float64); divisions and square roots correctly rounded (div, sqrt).
"""

import torch
import triton
import triton.language as tl

from fused.norm import ops as _ops
from fused.triton_math import div, sqrt
from fused.triton_utils import KEEP_SUBNORMALS, math_dtype, on_device_of, scalar_in, to_out

MAX_C = 65536  # elements per row one program holds
BACKWARD_PROGRAMS = 256  # about how many programs the backward launches (fixed: deterministic)


def _num_warps(block_c):
    return min(max(block_c // 256, 1), 16)


def _check_row(op, C):
    if C > MAX_C:
        raise RuntimeError(
            f"fused.{op}: the Triton kernel takes rows of at most {MAX_C} elements, got "
            f"normalized_shape of {C}; use fused.set_backend('cuda')"
        )


@triton.jit
def _norm_fwd_kernel(
    x_ptr,
    r_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    sum_ptr,
    mean_ptr,
    rstd_ptr,
    C,
    n: tl.float64,  # float64 scalars: a float64 kernel gets them exact (scalar_in rounds them for float32)
    eps: tl.float64,
    HAS_RESIDUAL: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    RMS: tl.constexpr,
    MATH: tl.constexpr,
    BLOCK_C: tl.constexpr,
    I64: tl.constexpr,
):
    row = tl.program_id(0)
    if I64:
        row = row.to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    mask = c < C
    h = tl.load(x_ptr + row * C + c, mask=mask, other=0.0).to(MATH)
    if HAS_RESIDUAL:  # the sum rounded to the residual stream's dtype; the norm reads it as rounded
        h_out = to_out(h + tl.load(r_ptr + row * C + c, mask=mask, other=0.0).to(MATH), sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * C + c, h_out, mask=mask)
        h = h_out.to(MATH)
    n = scalar_in(n, MATH)  # C as a float
    if RMS:
        mean = tl.zeros((), MATH)
        ms = div(tl.sum(h * h, axis=0), n)
    else:
        mean = div(tl.sum(h, axis=0), n)
        d = tl.where(mask, h - mean, 0.0)
        ms = div(tl.sum(d * d, axis=0), n)
        tl.store(mean_ptr + row, mean)
    rstd = div(1.0, sqrt(ms + scalar_in(eps, MATH)))
    tl.store(rstd_ptr + row, rstd)
    y = (h - mean) * rstd
    if HAS_W:
        y = y * tl.load(w_ptr + c, mask=mask, other=0.0).to(MATH)
    if HAS_B:
        y = y + tl.load(b_ptr + c, mask=mask, other=0.0).to(MATH)
    tl.store(out_ptr + row * C + c, to_out(y, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _norm_backward_kernel(
    g_ptr,
    gs_ptr,
    h_ptr,
    mean_ptr,
    rstd_ptr,
    w_ptr,
    dh_ptr,
    pw_ptr,
    pb_ptr,
    rows,
    C,
    n: tl.float64,
    rows_per_chunk,
    HAS_GS: tl.constexpr,
    HAS_W: tl.constexpr,
    W_GRAD: tl.constexpr,
    B_GRAD: tl.constexpr,
    RMS: tl.constexpr,
    MATH: tl.constexpr,
    BLOCK_C: tl.constexpr,
    I64: tl.constexpr,
):
    """grad_h = rstd * (gw - mean(gw) - xhat * mean(gw * xhat)) (+ grad_sum) for the rows of one chunk, with
    xhat = (h - mean) * rstd and gw = grad * weight; the chunk's sums of grad * xhat and grad go to
    partial[chunk, :]."""
    chunk = tl.program_id(0)
    if I64:
        chunk = chunk.to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    mask = c < C
    n = scalar_in(n, MATH)  # C as a float
    w = tl.full((BLOCK_C,), 1.0, MATH)
    if HAS_W:
        w = tl.load(w_ptr + c, mask=mask, other=0.0).to(MATH)
    acc_w = tl.zeros((BLOCK_C,), MATH)
    acc_b = tl.zeros((BLOCK_C,), MATH)
    for row in range(chunk * rows_per_chunk, tl.minimum((chunk + 1) * rows_per_chunk, rows)):
        h = tl.load(h_ptr + row * C + c, mask=mask, other=0.0).to(MATH)
        g = tl.load(g_ptr + row * C + c, mask=mask, other=0.0).to(MATH)
        rstd = tl.load(rstd_ptr + row)
        mean = tl.zeros((), MATH)
        if not RMS:
            mean = tl.load(mean_ptr + row)
        xhat = tl.where(mask, (h - mean) * rstd, 0.0)
        gw = g * w
        a = div(tl.sum(gw * xhat, axis=0), n)
        b = tl.zeros((), MATH)
        if not RMS:
            b = div(tl.sum(gw, axis=0), n)
        dh = rstd * ((gw - b) - xhat * a)
        if HAS_GS:
            dh = dh + tl.load(gs_ptr + row * C + c, mask=mask, other=0.0).to(MATH)
        tl.store(dh_ptr + row * C + c, to_out(dh, dh_ptr.dtype.element_ty), mask=mask)
        acc_w += g * xhat
        acc_b += g
    if W_GRAD:
        tl.store(pw_ptr + chunk * C + c, acc_w, mask=mask)
    if B_GRAD:
        tl.store(pb_ptr + chunk * C + c, acc_b, mask=mask)


def _needs_i64(t):
    return t.numel() >= 2**31


@on_device_of
def norm_fwd(x, residual, normalized_shape, weight, bias, eps, rms):
    op = _ops.op_name(rms, residual is not None)
    rows, C = _ops.check_fwd(op, x, residual, normalized_shape, weight, bias)
    _check_row(op, C)
    x = x.contiguous()
    residual = residual.contiguous() if residual is not None else None
    math = _ops.math_dtype(x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    total = torch.empty(x.shape, dtype=residual.dtype, device=x.device) if residual is not None else x.new_empty(0)
    mean = torch.empty(0 if rms else rows, dtype=math, device=x.device)
    rstd = torch.empty(rows, dtype=math, device=x.device)
    if rows == 0 or C == 0:
        return out, total, mean.fill_(float("nan")), rstd.fill_(float("nan"))
    params = [p.contiguous() if p is not None else x for p in (residual, weight, bias)]
    block_c = triton.next_power_of_2(C)
    _norm_fwd_kernel[(rows,)](
        x,
        *params,
        out,
        total if residual is not None else out,
        mean if not rms else rstd,
        rstd,
        C,
        float(C),
        float(eps),
        HAS_RESIDUAL=residual is not None,
        HAS_W=weight is not None,
        HAS_B=bias is not None,
        RMS=rms,
        MATH=math_dtype(x),
        BLOCK_C=block_c,
        I64=_needs_i64(x),
        num_warps=_num_warps(block_c),
        **KEEP_SUBNORMALS,
    )
    return out, total, mean, rstd


def backward_chunks(rows):
    """(chunks, rows per chunk) of the backward: a function of the row count only, so the partial sums and the
    order they are added in never change from run to run."""
    rows_per_chunk = triton.cdiv(rows, BACKWARD_PROGRAMS)
    return triton.cdiv(rows, rows_per_chunk), rows_per_chunk


@on_device_of
def norm_backward(grad, grad_sum, h, mean, rstd, weight, normalized_shape, rms, weight_grad, bias_grad):
    rows = _ops.check_backward("norm_backward", grad, grad_sum, h, mean, rstd, weight, normalized_shape, rms)
    C = h.numel() // rows if rows else 0
    _check_row("norm_backward", C)
    math = _ops.math_dtype(grad)
    ns = tuple(normalized_shape)
    grad_h = torch.empty(h.shape, dtype=h.dtype, device=h.device)
    grad_w = torch.zeros(ns if weight_grad else (0,), dtype=math, device=h.device)
    grad_b = torch.zeros(ns if bias_grad else (0,), dtype=math, device=h.device)
    if rows == 0 or C == 0:
        return grad_h, grad_w, grad_b
    chunks, rows_per_chunk = backward_chunks(rows)
    partial_w = torch.empty((chunks, C) if weight_grad else (0,), dtype=math, device=h.device)
    partial_b = torch.empty((chunks, C) if bias_grad else (0,), dtype=math, device=h.device)
    block_c = triton.next_power_of_2(C)
    grad, h = grad.contiguous(), h.contiguous()
    _norm_backward_kernel[(chunks,)](
        grad,
        grad_sum.contiguous() if grad_sum is not None else grad,
        h,
        mean.contiguous() if not rms else rstd,  # strided statistics are taken, as the CUDA binding takes them
        rstd.contiguous(),
        weight.contiguous() if weight is not None else grad,
        grad_h,
        partial_w,
        partial_b,
        rows,
        C,
        float(C),
        rows_per_chunk,
        HAS_GS=grad_sum is not None,
        HAS_W=weight is not None,
        W_GRAD=weight_grad,
        B_GRAD=bias_grad,
        RMS=rms,
        MATH=math_dtype(grad),
        BLOCK_C=block_c,
        I64=_needs_i64(h),
        num_warps=_num_warps(block_c),
        enable_fp_fusion=False,  # gw - mean(gw) from the same rounded gw (an fma would leave the product unrounded)
        **KEEP_SUBNORMALS,
    )
    # fixed-order torch reductions of the partial sums (no atomics)
    if weight_grad:
        grad_w = partial_w.sum(0).view(ns)
    if bias_grad:
        grad_b = partial_b.sum(0).view(ns)
    return grad_h, grad_w, grad_b


__all__ = ["norm_fwd", "norm_backward"]
