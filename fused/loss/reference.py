"""Plain-PyTorch reference of the loss family: the spec the kernels are tested against.

Without z_loss and softcap both ops are torch's: `cross_entropy` is F.cross_entropy (same shapes, class
weights, label smoothing, ignore_index, reductions) and `linear_cross_entropy` is F.cross_entropy(F.linear(...)),
which torch's F.linear_cross_entropy is too. The two extras extend them as Liger-Kernel does:

- softcap: the logits become softcap * tanh(logits / softcap) first (Gemma 2); everything else (cross-entropy,
  label smoothing, the logsumexp of the z-loss) sees the capped logits.
- z_loss: z_loss * logsumexp(logits)^2 is added for each token whose target is not ignore_index (PaLM). Class
  weights do not scale it and label smoothing does not touch it. reduction="mean" averages it over those tokens
  (their count), while the cross-entropy part keeps torch's weighted mean (divided by the summed class weights of
  the targets); "sum" sums both; "none" gives their sum per token (0 for an ignored token).
"""

import torch
import torch.nn.functional as F


def cross_entropy(
    logits, target, weight=None, reduction="mean", ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=None
):
    """logits (C), (N, C) or (N, C, d1, ...) and target (), (N) or (N, d1, ...), as F.cross_entropy."""
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    loss = F.cross_entropy(
        logits, target, weight=weight, reduction=reduction, ignore_index=ignore_index, label_smoothing=label_smoothing
    )
    if z_loss:
        valid = target != ignore_index
        per_token = torch.where(valid, z_loss * torch.logsumexp(logits, dim=min(1, logits.dim() - 1)).square(), 0)
        if reduction == "mean":
            per_token = per_token.sum() / valid.sum()
        elif reduction == "sum":
            per_token = per_token.sum()
        loss = loss + per_token
    return loss


def linear_cross_entropy(
    input,
    linear_weight,
    target,
    linear_bias=None,
    weight=None,
    reduction="mean",
    ignore_index=-100,
    label_smoothing=0.0,
    z_loss=0.0,
    softcap=None,
):
    """input [..., D], linear_weight [V, D], target [...]: cross_entropy of the logits F.linear(input, ...)."""
    logits = F.linear(input, linear_weight, linear_bias)
    loss = cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        target.reshape(-1),
        weight,
        reduction,
        ignore_index,
        label_smoothing,
        z_loss,
        softcap,
    )
    return loss.view(target.shape) if reduction == "none" else loss
