"""The loss family: cross-entropy fused with its softmax and gradient, and fused with the linear layer (the LM
head) before it, without ever holding the N x V logits."""

from typing import Optional

import torch

from fused.loss import ops as _ops  # noqa: F401  registers the composites, fake kernels, autograd, GPU routing


def linear_cross_entropy(
    input: torch.Tensor,
    linear_weight: torch.Tensor,
    target: torch.Tensor,
    *,
    linear_bias: Optional[torch.Tensor] = None,
    weight: Optional[torch.Tensor] = None,
    reduction: str = "mean",
    ignore_index: Optional[int] = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: Optional[float] = None,
) -> torch.Tensor:
    """F.cross_entropy(F.linear(input, linear_weight, linear_bias), target, ...) without the logits in memory: a
    drop-in for torch's F.linear_cross_entropy on every argument they share (ignore_index=None means -100).
    input [..., D], linear_weight [V, D], target [...] class indices. z_loss adds z_loss * logsumexp(logits)^2 per
    token (PaLM); softcap maps the logits to softcap * tanh(logits / softcap) first (Gemma 2); see
    fused/loss/reference.py for how they combine with class weights, label smoothing and the reductions.
    The loss has the input's dtype."""
    return torch.ops.fused.linear_cross_entropy(
        input,
        linear_weight,
        target,
        linear_bias=linear_bias,
        weight=weight,
        reduction=reduction,
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        z_loss=z_loss,
        softcap=softcap,
    )


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    weight: Optional[torch.Tensor] = None,
    reduction: str = "mean",
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: Optional[float] = None,
) -> torch.Tensor:
    """F.cross_entropy on given logits ((C), (N, C) or (N, C, d1, ...), class indices as targets) with z_loss and
    softcap as in linear_cross_entropy: one pass reads the logits and writes their gradient (in forward when
    autograd will want it)."""
    return torch.ops.fused.cross_entropy(
        logits,
        target,
        weight=weight,
        reduction=reduction,
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        z_loss=z_loss,
        softcap=softcap,
    )


__all__ = ["linear_cross_entropy", "cross_entropy"]
