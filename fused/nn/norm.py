"""FusedRMSNorm and FusedLayerNorm: torch.nn.RMSNorm / nn.LayerNorm (subclasses: the same parameters,
initialisation, state_dict and repr, and isinstance checks hold) whose forward runs the fused kernels and can take
the residual to add first."""

from typing import Optional

import torch
from torch import nn

from fused.norm import add_layer_norm, add_rms_norm, layer_norm, rms_norm


class FusedRMSNorm(nn.RMSNorm):
    """nn.RMSNorm(normalized_shape, eps=None, elementwise_affine=True). forward(x) gives rms_norm(x);
    forward(x, residual) gives (rms_norm(x + residual), x + residual) in one pass."""

    def forward(
        self, x: torch.Tensor, residual: Optional[torch.Tensor] = None, *, residual_dtype: Optional[torch.dtype] = None
    ):
        if residual is None:
            return rms_norm(x, self.normalized_shape, self.weight, self.eps)
        return add_rms_norm(x, residual, self.normalized_shape, self.weight, self.eps, residual_dtype=residual_dtype)


class FusedLayerNorm(nn.LayerNorm):
    """nn.LayerNorm(normalized_shape, eps=1e-5, elementwise_affine=True, bias=True). forward(x) gives
    layer_norm(x); forward(x, residual) gives (layer_norm(x + residual), x + residual) in one pass."""

    def forward(
        self, x: torch.Tensor, residual: Optional[torch.Tensor] = None, *, residual_dtype: Optional[torch.dtype] = None
    ):
        if residual is None:
            return layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return add_layer_norm(
            x, residual, self.normalized_shape, self.weight, self.bias, self.eps, residual_dtype=residual_dtype
        )
