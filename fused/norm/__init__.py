"""The norm family: RMSNorm and LayerNorm, alone or fused with the residual add before them. One read of each
input and one write of each output per row, statistics in float32 (float64 for float64), and weight / bias
gradients summed in a fixed order (the same bits every run, whatever the thread count).

The public functions run the composites that torch.ops.fused.<op> runs, without the dispatcher's round trip into
Python (about 4 us a call, as much as a small norm's kernel; fused._autograd.public)."""

import numbers
from typing import Optional, Sequence, Tuple, Union

import torch

from fused.norm import ops as _ops  # registers the composites, fake kernels, autograd, GPU routing

Shape = Union[int, Sequence[int]]


def _shape(op: str, normalized_shape: Shape) -> list:
    if isinstance(normalized_shape, (numbers.Integral, torch.SymInt)):
        return [normalized_shape]
    if isinstance(normalized_shape, Sequence) and not isinstance(normalized_shape, str):
        return list(normalized_shape)
    raise TypeError(
        f"fused.{op}: normalized_shape must be an int or a sequence of ints (torch.Size, list, tuple), got "
        f"{type(normalized_shape).__name__}"
    )


def rms_norm(
    x: torch.Tensor, normalized_shape: Shape, weight: Optional[torch.Tensor] = None, eps: Optional[float] = None
) -> torch.Tensor:
    """F.rms_norm: x / sqrt(mean(x^2) + eps) * weight over the trailing normalized_shape dims. eps=None: the
    machine epsilon of float32 (float64 for float64 x), as torch. Returns x's dtype; weight may be any float dtype."""
    return _ops.rms_norm(x, _shape("rms_norm", normalized_shape), weight, eps)


def layer_norm(
    x: torch.Tensor,
    normalized_shape: Shape,
    weight: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """F.layer_norm: (x - mean) / sqrt(var + eps) * weight + bias over the trailing normalized_shape dims."""
    return _ops.layer_norm(x, _shape("layer_norm", normalized_shape), weight, bias, eps)


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    normalized_shape: Shape,
    weight: Optional[torch.Tensor] = None,
    eps: Optional[float] = None,
    *,
    residual_dtype: Optional[torch.dtype] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(h), h) with h = x + residual, in one pass: the sum (the next block's residual) is rounded to the
    residual stream's dtype and normalised as rounded, as `h = x + residual; rms_norm(h)` does. The norm has x's
    dtype; the sum has residual_dtype, default residual's dtype, which may be x's or float32 for 16-bit x (a
    float32 residual stream with bf16 / fp16 activations)."""
    return _ops.add_rms_norm(
        x, residual, _shape("add_rms_norm", normalized_shape), weight, eps, residual_dtype=residual_dtype
    )


def add_layer_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    normalized_shape: Shape,
    weight: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    eps: float = 1e-5,
    *,
    residual_dtype: Optional[torch.dtype] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(layer_norm(h), h) with h = x + residual, in one pass; dtypes as add_rms_norm."""
    return _ops.add_layer_norm(
        x, residual, _shape("add_layer_norm", normalized_shape), weight, bias, eps, residual_dtype=residual_dtype
    )


__all__ = ["rms_norm", "layer_norm", "add_rms_norm", "add_layer_norm"]
