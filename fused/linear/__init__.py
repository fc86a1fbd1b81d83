"""The fused linear family: act(x @ weight.T + bias) as one GEMM with the bias and activation in its epilogue.

linear_act runs the composite that torch.ops.fused.linear_act runs, without the dispatcher's round trip into Python
(about 4 us a call; fused._autograd.public)."""

from typing import Optional

import torch

from fused.linear import ops as _ops  # registers the composite, fake kernels, autograd, GPU routing


def linear_act(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, act: str = "identity"
) -> torch.Tensor:
    """act(x @ weight.T + bias) for x [..., in_features], weight [out_features, in_features] as in nn.Linear,
    bias [out_features]. act: identity, relu, gelu (erf), gelu_tanh, silu, sigmoid, tanh.
    Autograd saves the pre-activation only for gelu, gelu_tanh and silu (the others differentiate from the
    output); the backward runs the activation derivative and the bias reduction in one pass, then two GEMMs."""
    return _ops.linear_act(x, weight, bias, act)


__all__ = ["linear_act"]
