"""Registration of the rope ops: fake kernels (torch.compile), autograd (the backward a fused op; the cos / sin
gradients, when asked for, composed of torch ops), and the CUDA-device routing between CUDA C++ and Triton."""

import torch

from fused import _checks
from fused._autograd import register_autograd
from fused._backend import register_gpu
from fused.rope import reference as _ref

TRITON = "fused.rope.triton_kernels"


# ---- checks shared by the fake kernels and the Triton launchers (as csrc/rope/rope_args.h) ----
def layout_of(op, unsqueeze_dim):
    """1: [b, h, s, d]; 2: [b, s, h, d] (-3 and -2 name the same dims)."""
    layout = {-3: 1, -2: 2}.get(unsqueeze_dim, unsqueeze_dim)
    if layout not in (1, 2):
        raise RuntimeError(
            f"fused.{op}: unsqueeze_dim must be 1 ([batch, heads, seq, head_dim]) or 2 "
            f"([batch, seq, heads, head_dim]), got {unsqueeze_dim}"
        )
    return layout


def heads_view(x, layout):
    """x seen as [b, h, s, d] (a view)."""
    return x.transpose(1, 2) if layout == 2 else x


def check_rope(op, first, second, q, k, cos, sin, unsqueeze_dim):
    """(b, s, d, hq, hk, r, cos_b); first / second name q and k (grad_q and grad_k in the backward)."""
    layout = layout_of(op, unsqueeze_dim)
    _checks.check_floating(op, first, q)
    _checks.check_like(op, second, k, first, q)
    _checks.check_like(op, "cos", cos, first, q)
    _checks.check_like(op, "sin", sin, first, q)
    dims = "[batch, heads, seq, head_dim]" if layout == 1 else "[batch, seq, heads, head_dim]"
    for name, t in ((first, q), (second, k)):
        if t.dim() != 4:
            raise RuntimeError(
                f"fused.{op}: {name} must be 4-D {dims} for unsqueeze_dim={unsqueeze_dim}, got shape {tuple(t.shape)}"
            )
    qv, kv = heads_view(q, layout), heads_view(k, layout)
    if (kv.shape[0], kv.shape[2], kv.shape[3]) != (qv.shape[0], qv.shape[2], qv.shape[3]):
        raise RuntimeError(
            f"fused.{op}: {second} of shape {tuple(k.shape)} does not match {first} of shape {tuple(q.shape)} "
            "in batch, seq and head_dim"
        )
    if cos.dim() != 3:
        raise RuntimeError(f"fused.{op}: cos must be 3-D [batch or 1, seq, r], got shape {tuple(cos.shape)}")
    if sin.shape != cos.shape:
        raise RuntimeError(f"fused.{op}: sin shape {tuple(sin.shape)} does not match cos shape {tuple(cos.shape)}")
    b, hq, s, d = qv.shape
    cos_b, r = cos.shape[0], cos.shape[2]
    if cos_b not in (1, b) or cos.shape[1] != s:
        raise RuntimeError(
            f"fused.{op}: cos of shape {tuple(cos.shape)} must be [{b} or 1, {s}, r] for {first} of shape "
            f"{tuple(q.shape)}"
        )
    if r % 2 or r > d:
        raise RuntimeError(f"fused.{op}: cos's last dim r = {r} must be even and at most head_dim {d}")
    return b, s, d, hq, kv.shape[1], r, cos_b


def output_like(x):
    """An output laid out as x (empty_like) where that layout has unit stride along head_dim, contiguous where not:
    every kernel writes rows with unit stride (csrc/rope/rope_args.h output_like)."""
    out = torch.empty_like(x)
    return out if out.stride(-1) == 1 or out.shape[-1] <= 1 else torch.empty(x.shape, dtype=x.dtype, device=x.device)


# ---- fake kernels: outputs laid out as the kernels lay them out (output_like) ----
@torch.library.register_fake("fused::rope")
def _(q, k, cos, sin, unsqueeze_dim=1, *, interleaved=False):
    check_rope("rope", "q", "k", q, k, cos, sin, unsqueeze_dim)
    return output_like(q), output_like(k)


@torch.library.register_fake("fused::rope_backward")
def _(grad_q, grad_k, cos, sin, unsqueeze_dim, interleaved):
    check_rope("rope_backward", "grad_q", "grad_k", grad_q, grad_k, cos, sin, unsqueeze_dim)
    return output_like(grad_q), output_like(grad_k)


# ---- autograd ----
def _setup(ctx, inputs, keyword_only_inputs, output):
    q, k, cos, sin, *rest = inputs
    ctx.unsqueeze_dim = rest[0] if rest else 1
    ctx.interleaved = keyword_only_inputs.get("interleaved", False)
    ctx.table_grads = cos.requires_grad or sin.requires_grad
    ctx.save_for_backward(cos, sin, *((q, k) if ctx.table_grads else ()))


def _backward(ctx, grad_q, grad_k):
    cos, sin, *qk = ctx.saved_tensors
    need_q, need_k, need_cos, need_sin = ctx.needs_input_grad[:4]
    grad_cos = grad_sin = None
    if need_cos or need_sin:
        grad_cos, grad_sin = _ref.table_grads(grad_q, grad_k, *qk, cos, sin, ctx.unsqueeze_dim, ctx.interleaved)
    if need_q or need_k:
        grad_q, grad_k = torch.ops.fused.rope_backward(grad_q, grad_k, cos, sin, ctx.unsqueeze_dim, ctx.interleaved)
    return (
        grad_q if need_q else None,
        grad_k if need_k else None,
        grad_cos if need_cos else None,
        grad_sin if need_sin else None,
        None,
    )


rope = register_autograd("rope", _backward, _setup)


# ---- CUDA tensors: CUDA C++ (fused::cuda_<op>, when compiled) or Triton ----
for _op in ("rope", "rope_backward"):
    register_gpu(_op, cuda_op=f"cuda_{_op}", triton=f"{TRITON}:{_op}")
