"""Modules over the fused ops: FusedLinear (nn.Linear + activation in one op), FusedMLP, and the norms
FusedRMSNorm / FusedLayerNorm (with the residual add fused in)."""
from fused.nn.linear import FusedLinear, FusedMLP
from fused.nn.norm import FusedLayerNorm, FusedRMSNorm

__all__ = ["FusedLinear", "FusedMLP", "FusedRMSNorm", "FusedLayerNorm"]
