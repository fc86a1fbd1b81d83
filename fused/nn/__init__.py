"""Modules over the fused ops: FusedLinear (nn.Linear + activation in one op), FusedMLP, and
FusedLinearCrossEntropyLoss (the LM-head loss without the logits)."""
from fused.nn.linear import FusedLinear, FusedMLP
from fused.nn.loss import FusedLinearCrossEntropyLoss

__all__ = ["FusedLinear", "FusedMLP", "FusedLinearCrossEntropyLoss"]
