"""FusedLinearCrossEntropyLoss: the LM-head loss as a module, fused.linear_cross_entropy with its options fixed."""

from typing import Optional

import torch
from torch import nn

from fused.loss import linear_cross_entropy
from fused.loss.ops import check_options


class FusedLinearCrossEntropyLoss(nn.Module):
    """loss(input, linear_weight, target, linear_bias=None) = fused.linear_cross_entropy(...) with this module's
    reduction, ignore_index, label_smoothing, z_loss and softcap. It holds no parameters: pass the LM head's (or
    the tied embedding's) weight."""

    def __init__(
        self,
        reduction: str = "mean",
        ignore_index: int = -100,
        label_smoothing: float = 0.0,
        z_loss: float = 0.0,
        softcap: Optional[float] = None,
    ):
        super().__init__()
        check_options("nn.FusedLinearCrossEntropyLoss", reduction, label_smoothing, z_loss, softcap)
        self.reduction, self.ignore_index, self.label_smoothing = reduction, ignore_index, label_smoothing
        self.z_loss, self.softcap = z_loss, softcap

    def forward(
        self,
        input: torch.Tensor,
        linear_weight: torch.Tensor,
        target: torch.Tensor,
        linear_bias: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        return linear_cross_entropy(
            input,
            linear_weight,
            target,
            linear_bias=linear_bias,
            reduction=self.reduction,
            ignore_index=self.ignore_index,
            label_smoothing=self.label_smoothing,
            z_loss=self.z_loss,
            softcap=self.softcap,
        )

    def extra_repr(self) -> str:
        return (
            f"reduction={self.reduction!r}, ignore_index={self.ignore_index}, "
            f"label_smoothing={self.label_smoothing}, z_loss={self.z_loss}, softcap={self.softcap}"
        )
