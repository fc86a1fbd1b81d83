"""The rope family: rotary position embedding of q and k in one pass over each (transformers'
apply_rotary_pos_emb), reading them where they lie (strided views of the projections), and its backward, the
rotation by -angle, a fused op too."""

from typing import Tuple

import torch

from fused.rope import ops as _ops  # registers the fake kernels, autograd, GPU routing; the op's eager entry point


def _mixed_tables(q, k, cos, sin):
    """Floating q and k of one dtype with floating tables of another (one dtype for both)."""
    tensors = (q, k, cos, sin)
    if not all(isinstance(t, torch.Tensor) and t.is_floating_point() for t in tensors):
        return False
    return q.dtype == k.dtype and cos.dtype == sin.dtype != q.dtype


def rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    unsqueeze_dim: int = 1,
    *,
    interleaved: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(q_embed, k_embed): drop-in for transformers' apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim).

    q is [b, hq, s, d] with unsqueeze_dim=1, or [b, s, hq, d] with 2; k likewise with its own head count (GQA,
    MQA). cos / sin are [b or 1, s, r] in q's dtype, transformers' tables (the r/2 frequencies repeated twice);
    r < d rotates the first r features and passes the rest through. interleaved=True rotates the pairs
    (x[2i], x[2i+1]) by angle i (cos[..., i], sin[..., i]) and keeps them in place (GPT-J / DeepSeek layout).
    The outputs are laid out as q and k; cos and sin get gradients when they require them. Tables of another
    floating dtype than q and k (float32 tables with bf16 q under autocast) promote as eager does: all four are
    converted to the promoted dtype first (the op itself, torch.ops.fused.rope, takes one dtype)."""
    if _mixed_tables(q, k, cos, sin):
        dtype = torch.promote_types(q.dtype, cos.dtype)
        q, k, cos, sin = (t.to(dtype) for t in (q, k, cos, sin))
    return _ops.rope(q, k, cos, sin, unsqueeze_dim, interleaved=interleaved)


__all__ = ["rope"]
