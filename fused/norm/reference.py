"""Plain-PyTorch references of the norm family: the spec the kernels are tested against. The norms are torch's
own (the ops are their drop-ins); the add variants add first, round the sum to the residual stream's dtype, and
normalise that rounded sum, as `h = x + residual; y = norm(h)` does in eager code; the norm is returned in x's
dtype, and the parameters are used in the sum's dtype (torch's layer_norm takes a float32 input only with float32
parameters)."""

import torch
import torch.nn.functional as F


def rms_norm(x, normalized_shape, weight=None, eps=None):
    return F.rms_norm(x, normalized_shape, weight, eps)


def layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    if weight is not None and weight.dtype != x.dtype:  # float32 weight on 16-bit x: torch's CUDA kernel refuses
        return F.layer_norm(x.float(), normalized_shape, weight.float(), _float(bias), eps).to(x.dtype)
    return F.layer_norm(x, normalized_shape, weight, bias, eps)


def _float(t):
    return None if t is None else t.float()


def residual_sum(x, residual, residual_dtype=None):
    """x + residual in the residual stream's dtype (residual_dtype, else residual's)."""
    dtype = residual_dtype or residual.dtype
    return x.to(dtype) + residual.to(dtype)


def _as(p, t):
    return None if p is None else p.to(t.dtype)


def add_rms_norm(x, residual, normalized_shape, weight=None, eps=None, residual_dtype=None):
    h = residual_sum(x, residual, residual_dtype)
    return rms_norm(h, normalized_shape, _as(weight, h), eps).to(x.dtype), h


def add_layer_norm(x, residual, normalized_shape, weight=None, bias=None, eps=1e-5, residual_dtype=None):
    h = residual_sum(x, residual, residual_dtype)
    return layer_norm(h, normalized_shape, _as(weight, h), _as(bias, h), eps).to(x.dtype), h


def norm_fwd(x, residual, normalized_shape, weight, bias, eps, rms):
    """The internal op's four outputs: the norm of h (x, or x + residual in residual's dtype) in x's dtype; the sum
    (empty without a residual); per row the mean (LayerNorm; else empty) and 1 / sqrt(variance + eps), in float32
    (float64 for float64 x)."""
    h = x if residual is None else residual_sum(x, residual)
    v = h.to(torch.float64 if x.dtype == torch.float64 else torch.float32)
    dims = tuple(range(-len(normalized_shape), 0))
    mean = v.mean(dims, keepdim=True) if not rms else torch.zeros((), dtype=v.dtype, device=v.device)
    rstd = torch.rsqrt((v - mean).pow(2).mean(dims, keepdim=True) + eps)
    out = (
        (v - mean) * rstd * (weight.to(v.dtype) if weight is not None else 1)
        + (bias.to(v.dtype) if bias is not None else 0)
    ).to(x.dtype)
    empty = x.new_empty(0)
    return (out, empty if residual is None else h, empty.to(v.dtype) if rms else mean.flatten(), rstd.flatten())
