"""Triton kernels of bias_dropout_add (and its backward) and unary_chain (and its backward); the launchers take
each op's own arguments. See triton_kernels.py for the family's conventions."""

import torch
import triton
import triton.language as tl

from fused._codes import parse_op
from fused.elementwise import ops as _ops
from fused.triton_math import NONE, keep_scale_at, keep_scale_block, unary_fwd, unary_grad_step
from fused.triton_utils import (
    KEEP_SUBNORMALS,
    flat_load,
    flat_meta,
    math_dtype,
    math_torch_dtype,
    on_device_of,
    program_2d,
    rows_cols,
    scalar_in,
    tile_index,
    tile_meta,
    to_out,
)

CHAIN_SLOTS = 16  # unary_chain ops per kernel pass
BIAS_GRAD_PROGRAMS = 1024  # about how many programs the bias-gradient kernels launch (fixed: deterministic)


# ---- dropout: the mask is Philox4x32-10 of the flat element index (csrc/common/philox.h), never stored ----
def _seed_value(op, seed):
    if not (
        isinstance(seed, torch.Tensor) and seed.device.type == "cpu" and seed.dtype == torch.int64 and seed.numel() == 1
    ):
        raise RuntimeError(f"fused.{op}: seed must be a CPU int64 tensor with one element")
    return int(seed.item())  # a CPU tensor: no device sync


def _check_p(op, p):
    if not 0.0 <= p <= 1.0:
        raise RuntimeError(f"fused.{op}: p must be in [0, 1], got {p}")


def _threshold_scale(p):
    """dropout_threshold(p) of csrc/common/philox.h (words below it are dropped) and the kept elements' scale."""
    threshold = 0 if p <= 0.0 else 1 << 32 if p >= 1.0 else int(p * 4294967296.0 + 0.5)
    return threshold, (1.0 / (1.0 - p) if p < 1.0 else 0.0)


@triton.jit(do_not_specialize=["seed", "threshold"])
def _dropout_kernel(
    x_ptr,
    b_ptr,
    res_ptr,
    y_ptr,
    n,
    cols,
    seed,
    threshold,
    scale: tl.float64,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    MATH: tl.constexpr,
    BLOCK: tl.constexpr,
    I64: tl.constexpr,
):
    """y = residual + dropout(x + bias); without residual and bias it is dropout_backward's grad_x."""
    offs, mask, h = flat_load(x_ptr, n, MATH, BLOCK, I64)
    if HAS_BIAS:
        h += tl.load(b_ptr + offs % cols, mask=mask).to(MATH)
    start = tl.program_id(0).to(tl.int64) * BLOCK
    h = h * keep_scale_block(start, BLOCK, seed, threshold, scalar_in(scale, MATH))
    if HAS_RESIDUAL:
        h = tl.load(res_ptr + offs, mask=mask).to(MATH) + h
    tl.store(y_ptr + offs, to_out(h, y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["seed", "threshold"])
def _dropout_bias_grad_kernel(
    g_ptr,
    gx_ptr,
    partial_ptr,
    rows,
    cols,
    rows_per_chunk,
    seed,
    threshold,
    scale: tl.float64,
    MATH: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    I64: tl.constexpr,
):
    """grad_x = grad * mask * scale over one chunk of rows, and the chunk's column sums into partial[chunk, :].
    Tiles are not aligned to the mask's 4-element groups, so each element runs its own Philox call."""
    chunk, col_block = program_2d(tl.cdiv(cols, BLOCK_C), I64)
    sc = scalar_in(scale, MATH)
    acc = tl.zeros((BLOCK_R, BLOCK_C), MATH)
    for R0 in range(chunk * rows_per_chunk, tl.minimum((chunk + 1) * rows_per_chunk, rows), BLOCK_R):
        r, c, mask = tile_index(R0, col_block, rows, BLOCK_R, cols, BLOCK_C, I64)
        index = r * cols + c
        gx = tl.load(g_ptr + index, mask=mask).to(MATH) * keep_scale_at(index, seed, threshold, sc)
        tl.store(gx_ptr + index, to_out(gx, gx_ptr.dtype.element_ty), mask=mask)
        acc += tl.where(mask, gx, 0.0)
    c = col_block * BLOCK_C + tl.arange(0, BLOCK_C)
    tl.store(partial_ptr + chunk * cols + c, tl.sum(acc, axis=0), mask=c < cols)


def _launch_dropout(x, bias, residual, p, seed):
    n = x.numel()
    y = torch.empty_like(x)
    if n:
        threshold, scale = _threshold_scale(p)
        grid, meta = flat_meta(math_dtype(x), n)
        _dropout_kernel[grid](
            x,
            bias if bias is not None else x,
            residual if residual is not None else x,
            y,
            n,
            x.shape[-1] if x.dim() else 1,
            seed,
            threshold,
            scale,
            HAS_BIAS=bias is not None,
            HAS_RESIDUAL=residual is not None,
            enable_fp_fusion=False,  # the CPU rounds (x + b) * keep before adding the residual
            **meta,
            **KEEP_SUBNORMALS,
        )
    return y


@on_device_of
def bias_dropout_add_seeded(x, bias, residual, p, seed):
    _ops.check_bias_dropout_add("bias_dropout_add", x, bias, residual, p)
    seed = _seed_value("bias_dropout_add", seed)
    return _launch_dropout(
        x.contiguous(), bias.contiguous() if bias is not None else None, residual.contiguous(), p, seed
    )


def bias_grad_chunks(rows, col_blocks, block_r):
    """Rows per chunk of the bias-gradient kernels: a function of the shape only, so the partial sums and the
    order they are added in never change from run to run (deterministic, no atomics)."""
    chunks = max(1, min(triton.cdiv(rows, block_r), BIAS_GRAD_PROGRAMS // col_blocks))
    rows_per_chunk = triton.cdiv(triton.cdiv(rows, chunks), block_r) * block_r
    return triton.cdiv(rows, rows_per_chunk), rows_per_chunk


@on_device_of
def dropout_backward(grad, p, seed, bias_grad):
    _ops._checks.check_floating("dropout_backward", "grad", grad)
    _check_p("dropout_backward", p)
    seed = _seed_value("dropout_backward", seed)
    grad = grad.contiguous()
    if not bias_grad:
        return _launch_dropout(grad, None, None, p, seed), grad.new_zeros(0)
    rows, cols = rows_cols(grad)
    grad_x = torch.empty_like(grad)
    if grad.numel() == 0:
        return grad_x, grad.new_zeros(cols)
    block_r, block_c, meta = tile_meta(grad, cols, grad.numel())
    col_blocks = triton.cdiv(cols, block_c)
    chunks, rows_per_chunk = bias_grad_chunks(rows, col_blocks, block_r)
    partial = torch.empty((chunks, cols), dtype=math_torch_dtype(grad), device=grad.device)
    threshold, scale = _threshold_scale(p)
    _dropout_bias_grad_kernel[(chunks * col_blocks,)](
        grad, grad_x, partial, rows, cols, rows_per_chunk, seed, threshold, scale, **meta, **KEEP_SUBNORMALS
    )
    return grad_x, partial.sum(0).to(grad.dtype)  # fixed-order torch reduction of the partial sums


# ---- unary_chain: up to CHAIN_SLOTS ops per pass, each slot's op a constexpr (straight-line code) ----
@triton.jit
def _chain_step(x, g, OP: tl.constexpr, s, GRAD: tl.constexpr, MATH: tl.constexpr):
    sv = scalar_in(s, MATH)
    if GRAD:
        g = unary_grad_step(g, x, OP, sv)
    return unary_fwd(x, OP, sv), g


@triton.jit
def _chain_kernel(
    x_ptr,
    g_ptr,
    y_ptr,
    gy_ptr,
    n,
    S0: tl.float64,
    S1: tl.float64,
    S2: tl.float64,
    S3: tl.float64,
    S4: tl.float64,
    S5: tl.float64,
    S6: tl.float64,
    S7: tl.float64,
    S8: tl.float64,
    S9: tl.float64,
    S10: tl.float64,
    S11: tl.float64,
    S12: tl.float64,
    S13: tl.float64,
    S14: tl.float64,
    S15: tl.float64,
    OP0: tl.constexpr,
    OP1: tl.constexpr,
    OP2: tl.constexpr,
    OP3: tl.constexpr,
    OP4: tl.constexpr,
    OP5: tl.constexpr,
    OP6: tl.constexpr,
    OP7: tl.constexpr,
    OP8: tl.constexpr,
    OP9: tl.constexpr,
    OP10: tl.constexpr,
    OP11: tl.constexpr,
    OP12: tl.constexpr,
    OP13: tl.constexpr,
    OP14: tl.constexpr,
    OP15: tl.constexpr,
    GRAD: tl.constexpr,
    STORE_Y: tl.constexpr,
    MATH: tl.constexpr,
    BLOCK: tl.constexpr,
    I64: tl.constexpr,
):
    """y = ops(x); with GRAD also gy = g * prod of each op's derivative at its input (the chain recomputed)."""
    offs, mask, x = flat_load(x_ptr, n, MATH, BLOCK, I64)
    g = x
    if GRAD:
        g = tl.load(g_ptr + offs, mask=mask).to(MATH)
    x, g = _chain_step(x, g, OP0, S0, GRAD, MATH)
    x, g = _chain_step(x, g, OP1, S1, GRAD, MATH)
    x, g = _chain_step(x, g, OP2, S2, GRAD, MATH)
    x, g = _chain_step(x, g, OP3, S3, GRAD, MATH)
    x, g = _chain_step(x, g, OP4, S4, GRAD, MATH)
    x, g = _chain_step(x, g, OP5, S5, GRAD, MATH)
    x, g = _chain_step(x, g, OP6, S6, GRAD, MATH)
    x, g = _chain_step(x, g, OP7, S7, GRAD, MATH)
    x, g = _chain_step(x, g, OP8, S8, GRAD, MATH)
    x, g = _chain_step(x, g, OP9, S9, GRAD, MATH)
    x, g = _chain_step(x, g, OP10, S10, GRAD, MATH)
    x, g = _chain_step(x, g, OP11, S11, GRAD, MATH)
    x, g = _chain_step(x, g, OP12, S12, GRAD, MATH)
    x, g = _chain_step(x, g, OP13, S13, GRAD, MATH)
    x, g = _chain_step(x, g, OP14, S14, GRAD, MATH)
    x, g = _chain_step(x, g, OP15, S15, GRAD, MATH)
    if STORE_Y:
        tl.store(y_ptr + offs, to_out(x, y_ptr.dtype.element_ty), mask=mask)
    if GRAD:
        tl.store(gy_ptr + offs, to_out(g, gy_ptr.dtype.element_ty), mask=mask)


def _chain_passes(op, ops):
    """The parsed chain ((name, scalar) per op) cut into passes of at most CHAIN_SLOTS ops (at least one)."""
    chain = [parse_op(op, spec)[::2] for spec in ops]
    return [chain[i : i + CHAIN_SLOTS] for i in range(0, len(chain), CHAIN_SLOTS)] or [[]]


def _launch_chain(x, g, y, gy, part, math):
    ops = part + [(NONE.value, 0.0)] * (CHAIN_SLOTS - len(part))
    scalars = {f"S{k}": s for k, (_, s) in enumerate(ops)}
    names = {f"OP{k}": name for k, (name, _) in enumerate(ops)}
    n = x.numel()
    grid, meta = flat_meta(math, n)
    _chain_kernel[grid](
        x,
        g if g is not None else x,
        y if y is not None else x,
        gy if gy is not None else x,
        n,
        **scalars,
        **names,
        GRAD=g is not None,
        STORE_Y=y is not None,
        **meta,
        **KEEP_SUBNORMALS,
    )


@on_device_of
def unary_chain(x, ops):
    """Chains longer than CHAIN_SLOTS run as several passes over an intermediate in the math type (one extra
    read and write of it per pass), so the result rounds to the input dtype only once, as in one pass."""
    _ops.check_unary_chain("unary_chain", x, ops)
    passes = _chain_passes("unary_chain", ops)
    x = x.contiguous()
    y = torch.empty_like(x)
    if x.numel() == 0:
        return y
    src = x
    for k, part in enumerate(passes):
        dst = y if k == len(passes) - 1 else src if src is not x else torch.empty_like(x, dtype=math_torch_dtype(x))
        _launch_chain(src, None, dst, None, part, math_dtype(x))
        src = dst
    return y


@on_device_of
def unary_chain_backward(grad, x, ops):
    """Each pass continues the chain from the values and gradient the previous pass left in math-type buffers
    (long chains: two extra tensors read and written per extra pass); the gradient is multiplied op by op in
    chain order, as in one pass."""
    _ops.check_unary_chain("unary_chain_backward", x, ops)
    _ops._checks.check_grad_like("unary_chain_backward", grad, "x", x)
    passes = _chain_passes("unary_chain_backward", ops)
    x, grad = x.contiguous(), grad.contiguous()
    grad_x = torch.empty_like(x)
    if x.numel() == 0:
        return grad_x
    if len(passes) > 1:
        buf_x = torch.empty_like(x, dtype=math_torch_dtype(x))
        buf_g = torch.empty_like(buf_x)
    xs, gs = x, grad
    for k, part in enumerate(passes):
        last = k == len(passes) - 1
        _launch_chain(xs, gs, None if last else buf_x, grad_x if last else buf_g, part, math_dtype(x))
        if not last:
            xs, gs = buf_x, buf_g
    return grad_x
