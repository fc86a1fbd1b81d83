"""Modules over the fused ops: FusedLinear (nn.Linear + activation in one op) and FusedMLP."""
from fused.nn.linear import FusedLinear, FusedMLP

__all__ = ["FusedLinear", "FusedMLP"]
