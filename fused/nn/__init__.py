"""Modules over the fused ops: FusedLinear (nn.Linear + activation in one op), FusedMLP, the norms
FusedRMSNorm / FusedLayerNorm (with the residual add fused in), and FusedLinearCrossEntropyLoss (the LM-head loss
without the logits)."""

from fused.nn.linear import FusedLinear, FusedMLP
from fused.nn.loss import FusedLinearCrossEntropyLoss
from fused.nn.norm import FusedLayerNorm, FusedRMSNorm

__all__ = ["FusedLinear", "FusedMLP", "FusedRMSNorm", "FusedLayerNorm", "FusedLinearCrossEntropyLoss"]
