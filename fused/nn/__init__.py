"""Modules over the fused ops: FusedLinear (nn.Linear + activation in one op), FusedMLP, the norms
FusedRMSNorm / FusedLayerNorm (with the residual add fused in), FusedLinearCrossEntropyLoss (the LM-head loss
without the logits), FusedLinearLogProbs and FusedLinearDistillationLoss."""

from fused.nn.linear import FusedLinear, FusedMLP
from fused.nn.loss import FusedLinearCrossEntropyLoss, FusedLinearDistillationLoss, FusedLinearLogProbs
from fused.nn.norm import FusedLayerNorm, FusedRMSNorm

__all__ = [
    "FusedLinear",
    "FusedMLP",
    "FusedRMSNorm",
    "FusedLayerNorm",
    "FusedLinearCrossEntropyLoss",
    "FusedLinearLogProbs",
    "FusedLinearDistillationLoss",
]
