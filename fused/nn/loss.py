"""The loss family's modules, each a functional op with its options fixed: FusedLinearCrossEntropyLoss (the LM-head
loss), FusedLinearLogProbs (per-token log-probs and entropy) and FusedLinearDistillationLoss."""

from typing import Optional

import torch
from torch import nn

from fused.loss import linear_cross_entropy, linear_distillation_loss, linear_log_probs
from fused.loss.distillation import check_options as check_distillation_options
from fused.loss.log_probs import check_temperature
from fused.loss.ops import check_options


class _FixedOptions(nn.Module):
    """A loss module whose options, named by OPTIONS, are attributes passed to its function by name (and shown by
    repr). It holds no parameters."""

    OPTIONS = ()

    def options(self, **given):
        """The keyword arguments of the function: those given (the call's tensors), then this module's options."""
        return {**given, **{name: getattr(self, name) for name in self.OPTIONS}}

    def extra_repr(self) -> str:
        return ", ".join(f"{name}={getattr(self, name)!r}" for name in self.OPTIONS)


class FusedLinearCrossEntropyLoss(_FixedOptions):
    """loss(input, linear_weight, target, linear_bias=None) = fused.linear_cross_entropy(...) with this module's
    reduction, ignore_index, label_smoothing, z_loss, softcap and class weights. It holds no parameters: pass the LM
    head's (or the tied embedding's) weight. weight (keyword): the class weights [V], a buffer as in
    nn.CrossEntropyLoss (so .to(), .half() and state_dict carry it)."""

    OPTIONS = ("reduction", "ignore_index", "label_smoothing", "z_loss", "softcap")

    def __init__(
        self,
        reduction: str = "mean",
        ignore_index: int = -100,
        label_smoothing: float = 0.0,
        z_loss: float = 0.0,
        softcap: Optional[float] = None,
        *,
        weight: Optional[torch.Tensor] = None,
    ):
        super().__init__()
        check_options("nn.FusedLinearCrossEntropyLoss", reduction, label_smoothing, z_loss, softcap)
        self.reduction, self.ignore_index, self.label_smoothing = reduction, ignore_index, label_smoothing
        self.z_loss, self.softcap = z_loss, softcap
        self.register_buffer("weight", weight)

    def forward(
        self,
        input: torch.Tensor,
        linear_weight: torch.Tensor,
        target: torch.Tensor,
        linear_bias: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        return linear_cross_entropy(
            input, linear_weight, target, **self.options(linear_bias=linear_bias, weight=self.weight)
        )


class FusedLinearLogProbs(_FixedOptions):
    """logp (and entropy) = fused.linear_log_probs(input, linear_weight, target, linear_bias=...) with this module's
    temperature, ignore_index and return_entropy. It holds no parameters: pass the policy head's weight."""

    OPTIONS = ("temperature", "ignore_index", "return_entropy")

    def __init__(self, temperature: float = 1.0, ignore_index: int = -100, return_entropy: bool = False):
        super().__init__()
        check_temperature("nn.FusedLinearLogProbs", temperature)
        self.temperature, self.ignore_index, self.return_entropy = temperature, ignore_index, return_entropy

    def forward(self, input, linear_weight, target, linear_bias=None):
        return linear_log_probs(input, linear_weight, target, **self.options(linear_bias=linear_bias))


class FusedLinearDistillationLoss(_FixedOptions):
    """loss(student_input, student_weight, teacher_input, teacher_weight, target=None, student_bias=None,
    teacher_bias=None) = fused.linear_distillation_loss(...) with this module's divergence, beta, temperature,
    ignore_index and reduction. It holds no parameters."""

    OPTIONS = ("divergence", "beta", "temperature", "ignore_index", "reduction")

    def __init__(
        self,
        divergence: str = "forward_kl",
        beta: float = 0.5,
        temperature: float = 1.0,
        ignore_index: int = -100,
        reduction: str = "mean",
    ):
        super().__init__()
        check_distillation_options("nn.FusedLinearDistillationLoss", divergence, beta, temperature, reduction)
        self.divergence, self.beta, self.temperature = divergence, beta, temperature
        self.ignore_index, self.reduction = ignore_index, reduction

    def forward(
        self,
        student_input,
        student_weight,
        teacher_input,
        teacher_weight,
        target=None,
        student_bias=None,
        teacher_bias=None,
    ):
        return linear_distillation_loss(
            student_input,
            student_weight,
            teacher_input,
            teacher_weight,
            target,
            **self.options(student_bias=student_bias, teacher_bias=teacher_bias),
        )
