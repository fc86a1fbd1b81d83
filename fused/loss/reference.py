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
    """logits (C), (N, C) or (N, C, d1, ...) and target (), (N) or (N, d1, ...) class indices, or class
    probabilities of the logits' shape (no token ignored), as F.cross_entropy."""
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    loss = F.cross_entropy(
        logits, target, weight=weight, reduction=reduction, ignore_index=ignore_index, label_smoothing=label_smoothing
    )
    if z_loss:
        lse_square = torch.logsumexp(logits, dim=min(1, logits.dim() - 1)).square()
        valid = torch.ones_like(lse_square, dtype=torch.bool) if target.is_floating_point() else target != ignore_index
        per_token = torch.where(valid, z_loss * lse_square, 0)
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
    """input [..., D], linear_weight [V, D], target [...] (or class probabilities [..., V]): cross_entropy of the
    logits F.linear(input, ...). A K-dimensional linear_weight [V, d1, ..., D] (linear_bias [V, d1, ...]) takes
    input [N, D] to logits [N, V, d1, ...], as torch's F.linear_cross_entropy."""
    bias = None if linear_bias is None else linear_bias.flatten()
    logits = F.linear(input, linear_weight.flatten(0, -2), bias)
    options = (weight, reduction, ignore_index, label_smoothing, z_loss, softcap)
    if linear_weight.dim() > 2:
        return cross_entropy(logits.view(input.shape[0], *linear_weight.shape[:-1]), target, *options)
    V = logits.shape[-1]
    flat_target = target.reshape(-1, V) if target.is_floating_point() else target.reshape(-1)
    loss = cross_entropy(logits.reshape(-1, V), flat_target, *options)
    return loss.view(input.shape[:-1]) if reduction == "none" else loss


def _weight_mul(p, d):
    """p * d, 0 where p is 0 (0 log 0 = 0: a masked, -inf, logit adds nothing), with finite gradients there."""
    return p * torch.where(p == 0, 0.0, d)


def _log_softmax(logits, temperature):
    """log_softmax(logits / temperature) in float32 (float64 for float64 logits)."""
    acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
    return (logits.to(acc) / temperature).log_softmax(-1)


def linear_log_probs(
    input, linear_weight, target, linear_bias=None, temperature=1.0, ignore_index=-100, return_entropy=False
):
    """input [..., D], linear_weight [V, D], target [...]: log_softmax(z)[target] with z = F.linear(...) /
    temperature in float32 (float64), and entropy -sum softmax(z) log_softmax(z); 0 where target is ignore_index."""
    logp_all = _log_softmax(F.linear(input, linear_weight, linear_bias), temperature)
    valid = target != ignore_index
    picked = logp_all.gather(-1, torch.where(valid, target, 0).unsqueeze(-1)).squeeze(-1)
    logp = torch.where(valid, picked, 0.0)
    if not return_entropy:
        return logp
    return logp, torch.where(valid, -_weight_mul(logp_all.exp(), logp_all).sum(-1), 0.0)


def linear_distillation_loss(
    student_input,
    student_weight,
    teacher_input,
    teacher_weight,
    target=None,
    student_bias=None,
    teacher_bias=None,
    divergence="forward_kl",
    beta=0.5,
    temperature=1.0,
    ignore_index=-100,
    reduction="mean",
):
    """The divergence between softmax(teacher logits / T) and softmax(student logits / T) per token (DESIGN.md), in
    float32 (float64), over the tokens whose target is not ignore_index (all when target is None; "mean" is 0 when
    none is counted); the teacher is a constant."""
    ls = _log_softmax(F.linear(student_input, student_weight, student_bias), temperature)
    with torch.no_grad():
        lt = _log_softmax(F.linear(teacher_input, teacher_weight, teacher_bias), temperature)
    if divergence == "forward_kl":
        per_token = _weight_mul(lt.exp(), lt - ls).sum(-1)
    elif divergence == "reverse_kl":
        per_token = _weight_mul(ls.exp(), ls - lt).sum(-1)
    else:  # log m = log(beta p_T + (1 - beta) p_S), as a logaddexp: beta = 0 or 1 gives exactly 0
        b = torch.tensor(beta, dtype=ls.dtype)
        lm = torch.logaddexp(lt + b.log(), ls + torch.log1p(-b))
        per_token = beta * _weight_mul(lt.exp(), lt - lm).sum(-1) + (1 - beta) * _weight_mul(ls.exp(), ls - lm).sum(-1)
    valid = torch.ones_like(per_token, dtype=torch.bool) if target is None else target != ignore_index
    per_token = torch.where(valid, per_token, 0.0)
    if reduction == "none":
        return per_token
    return per_token.sum() if reduction == "sum" else per_token.sum() / valid.sum().clamp_min(1)  # none counted: 0
