"""Triton kernels of the rope family, with launchers that take rope's and rope_backward's arguments
(csrc/rope/rope_schema.cpp) and return what those ops return. fused/rope/ops.py routes CUDA tensors here; under
TRITON_INTERPRET=1 the launchers also run on CPU tensors (that is how the tests check them).

One launch for q and k: program (position, head block) loads the position's cos / sin once and rotates a tile of
BLOCK_H heads x the rotary features, reading q / k by strides (a transposed projection is read where it lies); the
head blocks of q come first on grid axis 1, then k's. Features past r are copied. Math in float32 (float64 for
float64), rounded once to the output dtype."""

import triton
import triton.language as tl

from fused import triton_math as tm
from fused.rope import ops as _ops
from fused.triton_utils import KEEP_SUBNORMALS, math_dtype, needs_i64, on_device_of, to_out

MAX_R = 16384  # rotary features one program holds
TILE = 2048  # heads x half-features per program


@triton.jit
def _rotate_tile(
    x_ptr, o_ptr, x_strides, o_strides, b, s, head_block, heads, c1, c2, s1, s2, i, i_mask, r, d,
    INTERLEAVED: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr,
):  # fmt: skip
    """Rotates heads [head_block * BLOCK_H, +BLOCK_H) of x at (b, s) into o: out1 = x1 c1 - x2 s1, out2 = x2 c2 +
    x1 s2, with (x1, x2) the halves of the first r features, or the pairs (x[2i], x[2i+1]) when interleaved."""
    sxb, sxh, sxs = x_strides
    sob, soh, sos = o_strides
    h = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = h < heads
    x_row = x_ptr + b * sxb + s * sxs + h[:, None] * sxh
    o_row = o_ptr + b * sob + s * sos + h[:, None] * soh
    mask = h_mask[:, None] & i_mask[None, :]
    if INTERLEAVED:
        j1 = 2 * i
        j2 = j1 + 1
    else:
        j1 = i
        j2 = i + r // 2
    x1 = tl.load(x_row + j1[None, :], mask=mask, other=0.0).to(c1.dtype)
    x2 = tl.load(x_row + j2[None, :], mask=mask, other=0.0).to(c1.dtype)
    out = o_ptr.dtype.element_ty
    tl.store(o_row + j1[None, :], to_out(x1 * c1 - x2 * s1, out), mask=mask)
    tl.store(o_row + j2[None, :], to_out(x2 * c2 + x1 * s2, out), mask=mask)
    for p0 in range(r, d, BLOCK_P):  # the features past r, copied
        p = p0 + tl.arange(0, BLOCK_P)
        p_mask = h_mask[:, None] & (p < d)[None, :]
        tl.store(o_row + p[None, :], tl.load(x_row + p[None, :], mask=p_mask), mask=p_mask)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr, oq_ptr, ok_ptr,
    sqb, sqh, sqs, skb, skh, sks, soqb, soqh, soqs, sokb, sokh, soks,
    S, hq, hk, r, d, cos_batch_stride, q_blocks,
    INTERLEAVED: tl.constexpr, BACKWARD: tl.constexpr, MATH: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_P: tl.constexpr, I64: tl.constexpr,
):  # fmt: skip
    pos = tl.program_id(0)
    if I64:
        pos = pos.to(tl.int64)
    b = pos // S
    s = pos % S
    half = r // 2
    i = tl.arange(0, BLOCK_I)
    i_mask = i < half
    table = cos_ptr + b * cos_batch_stride + s * r
    sin_row = sin_ptr + b * cos_batch_stride + s * r
    if INTERLEAVED:  # angle i for the pair (2i, 2i+1); the transpose rotates by -angle
        c1 = tl.load(table + i, mask=i_mask, other=0.0).to(MATH)
        c2 = c1
        s1 = tl.load(sin_row + i, mask=i_mask, other=0.0).to(MATH)
        if BACKWARD:
            s1 = tm.neg(s1)
        s2 = s1
    else:  # rotate_half's transpose swaps the sin halves and negates them
        c1 = tl.load(table + i, mask=i_mask, other=0.0).to(MATH)
        c2 = tl.load(table + half + i, mask=i_mask, other=0.0).to(MATH)
        s1 = tl.load(sin_row + i, mask=i_mask, other=0.0).to(MATH)
        s2 = tl.load(sin_row + half + i, mask=i_mask, other=0.0).to(MATH)
        if BACKWARD:
            s1, s2 = tm.neg(s2), tm.neg(s1)
    c1, c2, s1, s2 = c1[None, :], c2[None, :], s1[None, :], s2[None, :]
    block = tl.program_id(1)
    if block < q_blocks:
        _rotate_tile(
            q_ptr, oq_ptr, (sqb, sqh, sqs), (soqb, soqh, soqs), b, s, block, hq, c1, c2, s1, s2, i, i_mask, r, d,
            INTERLEAVED, BLOCK_H, BLOCK_P,
        )  # fmt: skip
    else:
        _rotate_tile(
            k_ptr, ok_ptr, (skb, skh, sks), (sokb, sokh, soks), b, s, block - q_blocks, hk, c1, c2, s1, s2, i,
            i_mask, r, d, INTERLEAVED, BLOCK_H, BLOCK_P,
        )  # fmt: skip


def _extent(t):
    """1 + the largest element offset t reaches (its storage span, for the 64-bit offset choice)."""
    return 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if n > 0)


def _rope(op, first, second, q, k, cos, sin, unsqueeze_dim, interleaved, backward):
    b, s, d, hq, hk, r, cos_b = _ops.check_rope(op, first, second, q, k, cos, sin, unsqueeze_dim)
    if r // 2 > MAX_R // 2:
        raise RuntimeError(
            f"fused.{op}: the Triton kernel takes at most {MAX_R} rotary features, got r = {r}; "
            "use fused.set_backend('cuda')"
        )
    layout = _ops.layout_of(op, unsqueeze_dim)
    out_q, out_k = _ops.output_like(q), _ops.output_like(k)
    if b * s == 0 or d == 0 or hq + hk == 0:
        return out_q, out_k
    q, k = (x if x.stride(-1) == 1 or x.shape[-1] <= 1 else x.contiguous() for x in (q, k))
    views = [_ops.heads_view(t, layout) for t in (q, k, out_q, out_k)]
    cos, sin = cos.contiguous(), sin.contiguous()
    block_i = triton.next_power_of_2(max(r // 2, 1))
    block_h = max(1, min(triton.next_power_of_2(max(hq, hk, 1)), TILE // block_i))
    q_blocks = triton.cdiv(hq, block_h)
    strides = [st for v in views for st in v.stride()[:3]]
    _rope_kernel[(b * s, q_blocks + triton.cdiv(hk, block_h))](
        q, k, cos, sin, out_q, out_k, *strides, s, hq, hk, r, d, 0 if cos_b == 1 else s * r, q_blocks,
        INTERLEAVED=interleaved, BACKWARD=backward, MATH=math_dtype(q), BLOCK_H=block_h, BLOCK_I=block_i,
        BLOCK_P=min(triton.next_power_of_2(max(d - r, 1)), 128), I64=needs_i64(*(_extent(v) for v in views)),
        num_warps=4, **KEEP_SUBNORMALS
    )  # fmt: skip
    return out_q, out_k


@on_device_of
def rope(q, k, cos, sin, unsqueeze_dim=1, *, interleaved=False):
    return _rope("rope", "q", "k", q, k, cos, sin, unsqueeze_dim, interleaved, False)


@on_device_of
def rope_backward(grad_q, grad_k, cos, sin, unsqueeze_dim, interleaved):
    return _rope("rope_backward", "grad_q", "grad_k", grad_q, grad_k, cos, sin, unsqueeze_dim, interleaved, True)


__all__ = ["rope", "rope_backward"]
