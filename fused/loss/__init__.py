"""The loss family: cross-entropy fused with its softmax and gradient, and fused with the linear layer (the LM
head) before it; per-token log-probs and entropy, and teacher-student distillation, of linear heads; none of them
ever holding the N x V logits."""

from typing import Optional

import torch

from fused.loss import distillation as _distillation  # noqa: F401  (each registers its composites, fake kernels,
from fused.loss import log_probs as _log_probs  # noqa: F401  autograd and GPU routing)
from fused.loss import ops as _ops  # noqa: F401


def _cross_entropy_options(weight, reduction, ignore_index, label_smoothing, z_loss, softcap):
    """The keyword arguments linear_cross_entropy and cross_entropy share, by their schemas' names."""
    return dict(
        weight=weight,
        reduction=reduction,
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        z_loss=z_loss,
        softcap=softcap,
    )


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
    input [..., D], linear_weight [V, D], target [...] class indices (or class probabilities [..., V]; and
    linear_weight [V, d1, ..., D] for input [N, D], target [N, d1, ...]: these two take the whole logits). z_loss
    adds z_loss * logsumexp(logits)^2 per token (PaLM); softcap maps the logits to softcap * tanh(logits / softcap)
    first (Gemma 2); see fused/loss/reference.py for how they combine with class weights, label smoothing and the
    reductions.
    The loss has the input's dtype."""
    return torch.ops.fused.linear_cross_entropy(
        input,
        linear_weight,
        target,
        linear_bias=linear_bias,
        **_cross_entropy_options(weight, reduction, ignore_index, label_smoothing, z_loss, softcap),
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
    """F.cross_entropy on given logits ((C), (N, C) or (N, C, d1, ...); class indices or probabilities) with z_loss and
    softcap as in linear_cross_entropy: one pass reads the logits and writes their gradient (in forward when
    autograd will want it)."""
    return torch.ops.fused.cross_entropy(
        logits, target, **_cross_entropy_options(weight, reduction, ignore_index, label_smoothing, z_loss, softcap)
    )


def linear_log_probs(
    input: torch.Tensor,
    linear_weight: torch.Tensor,
    target: torch.Tensor,
    *,
    linear_bias: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
    ignore_index: int = -100,
    return_entropy: bool = False,
):
    """Per-token log-probs of the targets under a linear head, without the N x V logits: with
    z = (input @ linear_weight.T + linear_bias) / temperature, logp = log_softmax(z)[target] (and, when
    return_entropy, entropy = -sum softmax(z) log_softmax(z)), shaped like target, in float32 (float64 for float64
    input) whatever the input dtype. Ignored tokens give 0 and no gradient. Gradients reach input, linear_weight and
    linear_bias from any use of logp and entropy (per-token weights, ratios, sums per sequence: RL, DPO).
    torch.ops.fused.linear_log_probs returns (logp, entropy), entropy empty unless asked for."""
    logp, entropy = torch.ops.fused.linear_log_probs(
        input,
        linear_weight,
        target,
        linear_bias=linear_bias,
        temperature=temperature,
        ignore_index=ignore_index,
        return_entropy=return_entropy,
    )
    return (logp, entropy) if return_entropy else logp


def linear_distillation_loss(
    student_input: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_input: torch.Tensor,
    teacher_weight: torch.Tensor,
    target: Optional[torch.Tensor] = None,
    *,
    student_bias: Optional[torch.Tensor] = None,
    teacher_bias: Optional[torch.Tensor] = None,
    divergence: str = "forward_kl",
    beta: float = 0.5,
    temperature: float = 1.0,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """A divergence between the teacher's and the student's next-token distributions, p = softmax(logits /
    temperature) of each linear head, without either's N x V logits: "forward_kl" KL(p_T || p_S), "reverse_kl"
    KL(p_S || p_T), "jsd" beta KL(p_T || m) + (1 - beta) KL(p_S || m) with m = beta p_T + (1 - beta) p_S. Tokens
    whose target is ignore_index are left out (all count when target is None); "mean" over the counted tokens (0,
    with zero gradients, when none is), "sum", or "none" per token (0 where ignored). TRL's generalized_jsd_loss and
    Liger's JSD losses take beta = 0 as KL(p_T || p_S) and beta = 1 as KL(p_S || p_T): here those are "forward_kl"
    and "reverse_kl" ("jsd" at beta 0 or 1 compares a distribution with itself: 0). The teacher gets no gradient;
    teacher and student may have different hidden sizes (and dtypes), not vocabularies. The loss is float32 (float64
    for float64 input)."""
    return torch.ops.fused.linear_distillation_loss(
        student_input,
        student_weight,
        teacher_input,
        teacher_weight,
        target,
        student_bias=student_bias,
        teacher_bias=teacher_bias,
        divergence=divergence,
        beta=beta,
        temperature=temperature,
        ignore_index=ignore_index,
        reduction=reduction,
    )


__all__ = ["linear_cross_entropy", "cross_entropy", "linear_log_probs", "linear_distillation_loss"]
