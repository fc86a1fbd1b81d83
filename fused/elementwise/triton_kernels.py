"""Triton kernels of the fused elementwise family, with launchers that take each op's own arguments
(csrc/elementwise/elementwise_schema.cpp) and return what the op returns. fused/elementwise/ops.py routes CUDA
tensors here; under TRITON_INTERPRET=1 the launchers also run on CPU tensors (that is how the tests check them).

Math runs in float32 (float64 for float64 inputs) and results are stored in the input dtype, like the C++
kernels. Layouts: flat 1-D blocks where every element is independent; [rows, cols] tiles where a row vector is
involved (bias, bias gradient, glu's strided halves). Offsets become 64-bit only when a tensor needs it.
"""

import torch
import triton
import triton.language as tl

from fused.elementwise import ops as _ops
from fused.elementwise.triton_dropout_chain import (
    bias_dropout_add_seeded,
    bias_grad_chunks,
    dropout_backward,
    unary_chain,
    unary_chain_backward,
)
from fused.triton_math import act_backward, act_fwd
from fused.triton_utils import (
    KEEP_SUBNORMALS,
    math_torch_dtype,
    on_device_of,
    program_2d,
    program_tile,
    rows_cols,
    tile_index,
    tile_meta,
    to_out,
)


# ---- bias_act ----
@triton.jit
def _bias_act_kernel(
    x_ptr,
    b_ptr,
    y_ptr,
    rows,
    cols,
    ACT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    MATH: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    I64: tl.constexpr,
):
    r, c, mask = program_tile(rows, cols, BLOCK_R, BLOCK_C, I64)
    h = tl.load(x_ptr + r * cols + c, mask=mask).to(MATH)
    if HAS_BIAS:
        h += tl.load(b_ptr + c, mask=c < cols).to(MATH)
    tl.store(y_ptr + r * cols + c, to_out(act_fwd(h, ACT), y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bias_act_backward_kernel(
    g_ptr,
    x_ptr,
    b_ptr,
    gx_ptr,
    partial_ptr,
    rows,
    cols,
    rows_per_chunk,
    ACT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    MATH: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    I64: tl.constexpr,
):
    """grad_x = grad * act'(x + bias) over one chunk of rows; with a bias, the chunk's column sums of grad_x
    (in the math type) go to partial[chunk, :]."""
    chunk, col_block = program_2d(tl.cdiv(cols, BLOCK_C), I64)
    c = col_block * BLOCK_C + tl.arange(0, BLOCK_C)
    bias = tl.zeros((BLOCK_C,), MATH)
    if HAS_BIAS:
        bias = tl.load(b_ptr + c, mask=c < cols).to(MATH)
    acc = tl.zeros((BLOCK_R, BLOCK_C), MATH)
    for R0 in range(chunk * rows_per_chunk, tl.minimum((chunk + 1) * rows_per_chunk, rows), BLOCK_R):
        r, c2, mask = tile_index(R0, col_block, rows, BLOCK_R, cols, BLOCK_C, I64)
        h = tl.load(x_ptr + r * cols + c2, mask=mask).to(MATH) + bias[None, :]
        gx = act_backward(tl.load(g_ptr + r * cols + c2, mask=mask).to(MATH), h, ACT)
        tl.store(gx_ptr + r * cols + c2, to_out(gx, gx_ptr.dtype.element_ty), mask=mask)
        if HAS_BIAS:
            acc += tl.where(mask, gx, 0.0)
    if HAS_BIAS:
        tl.store(partial_ptr + chunk * cols + c, tl.sum(acc, axis=0), mask=c < cols)


@on_device_of
def bias_act(x, bias=None, act="gelu"):
    _ops.check_bias_act("bias_act", x, bias, act)
    x = x.contiguous()
    y = torch.empty_like(x)
    rows, cols = rows_cols(x)
    if x.numel() == 0:
        return y
    block_r, block_c, meta = tile_meta(x, cols, x.numel())
    grid = (triton.cdiv(rows, block_r) * triton.cdiv(cols, block_c),)
    b = bias.contiguous() if bias is not None else x
    _bias_act_kernel[grid](x, b, y, rows, cols, ACT=act, HAS_BIAS=bias is not None, **meta, **KEEP_SUBNORMALS)
    return y


@on_device_of
def bias_act_backward(grad, x, bias, act):
    _ops.check_bias_act("bias_act_backward", x, bias, act)
    _ops._checks.check_grad_like("bias_act_backward", grad, "x", x)
    x, grad = x.contiguous(), grad.contiguous()
    grad_x = torch.empty_like(x)
    rows, cols = rows_cols(x)
    if x.numel() == 0:
        return grad_x, torch.zeros_like(bias) if bias is not None else x.new_empty(0)
    block_r, block_c, meta = tile_meta(x, cols, x.numel())
    col_blocks = triton.cdiv(cols, block_c)
    if bias is not None:
        chunks, rows_per_chunk = bias_grad_chunks(rows, col_blocks, block_r)
        partial = torch.empty((chunks, cols), dtype=math_torch_dtype(x), device=x.device)
    else:  # one chunk per row block; no partial sums
        chunks, rows_per_chunk, partial = triton.cdiv(rows, block_r), block_r, grad_x
    b = bias.contiguous() if bias is not None else x
    _bias_act_backward_kernel[(chunks * col_blocks,)](
        grad,
        x,
        b,
        grad_x,
        partial,
        rows,
        cols,
        rows_per_chunk,
        ACT=act,
        HAS_BIAS=bias is not None,
        **meta,
        **KEEP_SUBNORMALS,
    )
    if bias is None:
        return grad_x, x.new_empty(0)
    return grad_x, partial.sum(0).to(bias.dtype)  # fixed-order torch reduction of the partial sums (no atomics)


# ---- glu: act(gate) * up, gate and up read as rows with a row stride ----
def _as_rows(t):
    """(tensor, rows, cols, row stride): a [rows, cols] view of t with unit column stride, read in place when
    the strides allow it (e.g. the halves of a chunked [.., 2C] tensor), else a contiguous copy. Mirrors as_rows
    in csrc/elementwise/elementwise_cpu.cpp."""
    cols = t.shape[-1] if t.dim() else 1
    rows = t.numel() // cols if cols else 0
    ok = t.dim() <= 1 or t.stride(-1) == 1
    stride = t.stride(-2) if t.dim() >= 2 else cols
    expected = stride
    for d in range(t.dim() - 2, -1, -1):
        if not ok:
            break
        if t.shape[d] != 1 and t.stride(d) != expected:
            ok = False
        expected *= t.shape[d]
    if t.dim() == 1 and t.stride(0) != 1:
        ok = False
    if not ok or stride < cols:
        t, stride = t.contiguous(), cols
    if t.dim() >= 2 and t.shape[-2] == 1 and ok:
        stride = max(stride, cols)
    return t, rows, cols, stride


@triton.jit
def _glu_kernel(
    gate_ptr,
    up_ptr,
    grad_ptr,
    y_ptr,
    gup_ptr,
    rows,
    cols,
    gate_stride,
    up_stride,
    ACT: tl.constexpr,
    BACKWARD: tl.constexpr,
    MATH: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    I64: tl.constexpr,
):
    """Forward: y = act(gate) * up. Backward: y = grad_gate = grad * up * act'(gate), gup = grad * act(gate)."""
    r, c, mask = program_tile(rows, cols, BLOCK_R, BLOCK_C, I64)
    gate = tl.load(gate_ptr + r * gate_stride + c, mask=mask).to(MATH)
    up = tl.load(up_ptr + r * up_stride + c, mask=mask).to(MATH)
    if BACKWARD:
        d = tl.load(grad_ptr + r * cols + c, mask=mask).to(MATH)
        tl.store(gup_ptr + r * cols + c, to_out(d * act_fwd(gate, ACT), gup_ptr.dtype.element_ty), mask=mask)
        y = act_backward(d * up, gate, ACT)
    else:
        y = act_fwd(gate, ACT) * up
    tl.store(y_ptr + r * cols + c, to_out(y, y_ptr.dtype.element_ty), mask=mask)


def _launch_glu(gate, up, grad, act, backward):
    g, rows, cols, g_stride = _as_rows(gate)
    u, _, _, u_stride = _as_rows(up)
    y = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    grad_up = torch.empty_like(y) if backward else y
    if y.numel():
        block_r, block_c, meta = tile_meta(gate, cols, rows * max(g_stride, u_stride, cols))
        grid = (triton.cdiv(rows, block_r) * triton.cdiv(cols, block_c),)
        d = grad if backward else g
        _glu_kernel[grid](
            g, u, d, y, grad_up, rows, cols, g_stride, u_stride, ACT=act, BACKWARD=backward, **meta, **KEEP_SUBNORMALS
        )
    return (y, grad_up) if backward else y


@on_device_of
def glu(gate, up, act="silu"):
    _ops.check_glu("glu", gate, up, act)
    return _launch_glu(gate, up, None, act, backward=False)


@on_device_of
def glu_backward(grad, gate, up, act):
    _ops.check_glu("glu_backward", gate, up, act)
    _ops._checks.check_grad_like("glu_backward", grad, "gate", gate)
    return _launch_glu(gate, up, grad.contiguous(), act, backward=True)


__all__ = [
    "bias_act",
    "bias_act_backward",
    "glu",
    "glu_backward",
    "bias_dropout_add_seeded",
    "dropout_backward",
    "unary_chain",
    "unary_chain_backward",
]
