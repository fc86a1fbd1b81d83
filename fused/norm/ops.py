"""Registration of the norm ops: the public composites (rms_norm, layer_norm, add_rms_norm, add_layer_norm) over
norm_fwd, fake kernels (torch.compile), autograd (backward made of fused ops), and the CUDA-device routing between
the CUDA C++ and Triton kernels."""

import math

import torch

from fused import _checks
from fused._autocast import autocast_float32
from fused._autograd import public, register_autograd
from fused._backend import register_gpu

TRITON = "fused.norm.triton_kernels"
HALF_DTYPES = (torch.float16, torch.bfloat16)


# ---- checks shared by the fake kernels, the composites and the Triton launchers (as csrc/norm/norm_args.h) ----
def op_name(rms, add):
    return ("add_" if add else "") + ("rms_norm" if rms else "layer_norm")


def math_dtype(t):
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def rows_shape(op, x, normalized_shape):
    """(rows, C): x as rows of C = prod(normalized_shape) elements."""
    ns = tuple(normalized_shape)
    if not ns:
        raise RuntimeError(f"fused.{op}: normalized_shape must have at least one dimension")
    lead = x.dim() - len(ns)
    if lead < 0 or tuple(x.shape[lead:]) != ns:
        raise RuntimeError(f"fused.{op}: x of shape {tuple(x.shape)} does not end with normalized_shape {ns}")
    return math.prod(x.shape[:lead]), math.prod(ns)


def check_param(op, name, p, x, normalized_shape):
    _checks.check_floating(op, name, p)
    if p.device != x.device:
        raise RuntimeError(f"fused.{op}: {name} is on {p.device} but x is on {x.device}")
    if tuple(p.shape) != tuple(normalized_shape):
        raise RuntimeError(
            f"fused.{op}: {name} must have shape normalized_shape {tuple(normalized_shape)}, got {tuple(p.shape)}"
        )


def residual_dtype_ok(x_dtype, r_dtype):
    """The residual stream takes x's dtype, or float32 for 16-bit x."""
    return r_dtype == x_dtype or (r_dtype == torch.float32 and x_dtype in HALF_DTYPES)


def check_fwd(op, x, residual, normalized_shape, weight, bias):
    _checks.check_floating(op, "x", x)
    shape = rows_shape(op, x, normalized_shape)
    if residual is not None:
        _checks.check_floating(op, "residual", residual)
        if residual.device != x.device:
            raise RuntimeError(f"fused.{op}: residual is on {residual.device} but x is on {x.device}")
        _checks.check_same_shape(op, "residual", residual, "x", x)
        if not residual_dtype_ok(x.dtype, residual.dtype):
            raise RuntimeError(
                f"fused.{op}: residual has dtype {residual.dtype} but x has dtype {x.dtype} (the "
                "residual stream takes x's dtype, or float32 for 16-bit x)"
            )
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None:
            check_param(op, name, p, x, normalized_shape)
    return shape


def check_backward(op, grad, grad_sum, h, mean, rstd, weight, normalized_shape, rms):
    _checks.check_floating(op, "grad", grad)
    rows, _ = rows_shape(op, h, normalized_shape)
    if grad.device != h.device or grad.shape != h.shape:
        raise RuntimeError(
            f"fused.{op}: grad ({tuple(grad.shape)} on {grad.device}) must match h ({tuple(h.shape)} on {h.device})"
        )
    if not residual_dtype_ok(grad.dtype, h.dtype):
        raise RuntimeError(f"fused.{op}: h has dtype {h.dtype} but grad has dtype {grad.dtype}")
    if grad_sum is not None:
        _checks.check_like(op, "grad_sum", grad_sum, "h", h)
        _checks.check_same_shape(op, "grad_sum", grad_sum, "h", h)
    for t in (rstd,) if rms else (mean, rstd):
        if t.dtype != math_dtype(grad) or t.device != h.device or t.numel() != rows:
            raise RuntimeError(f"fused.{op}: mean and rstd must hold one {math_dtype(grad)} per row on h's device")
    if weight is not None:
        check_param(op, "weight", weight, h, normalized_shape)
    return rows


# ---- fake kernels ----
@torch.library.register_fake("fused::norm_fwd")
def _(x, residual, normalized_shape, weight, bias, eps, rms):
    rows, _ = check_fwd(op_name(rms, residual is not None), x, residual, normalized_shape, weight, bias)
    total = residual.new_empty(x.shape) if residual is not None else x.new_empty(0)
    return (
        x.new_empty(x.shape),
        total,
        x.new_empty(0 if rms else rows, dtype=math_dtype(x)),
        x.new_empty(rows, dtype=math_dtype(x)),
    )


@torch.library.register_fake("fused::norm_backward")
def _(grad, grad_sum, h, mean, rstd, weight, normalized_shape, rms, weight_grad, bias_grad):
    check_backward("norm_backward", grad, grad_sum, h, mean, rstd, weight, normalized_shape, rms)
    ns = tuple(normalized_shape)
    return (
        h.new_empty(h.shape),
        h.new_empty(ns if weight_grad else (0,), dtype=math_dtype(grad)),
        h.new_empty(ns if bias_grad else (0,), dtype=math_dtype(grad)),
    )


# ---- autograd of norm_fwd ----
def _setup(ctx, inputs, output):
    x, residual, normalized_shape, weight, bias, eps, rms = inputs
    _, total, mean, rstd = output
    ctx.save_for_backward(x if residual is None else total, mean, rstd, weight)
    ctx.mark_non_differentiable(mean, rstd, *(() if residual is not None else (total,)))
    ctx.set_materialize_grads(False)
    ctx.normalized_shape, ctx.rms, ctx.x_dtype = normalized_shape, rms, x.dtype
    ctx.param_dtypes = tuple(p.dtype if p is not None else None for p in (weight, bias))


def _backward(ctx, grad, grad_sum, _grad_mean, _grad_rstd):
    h, mean, rstd, weight = ctx.saved_tensors
    need_x, need_residual, _, need_weight, need_bias = ctx.needs_input_grad[:5]
    grad_h = grad_weight = grad_bias = None
    if grad is None:  # only the sum was used: its gradient passes through
        grad_h = grad_sum
    else:
        grad_h, grad_weight, grad_bias = torch.ops.fused.norm_backward(
            grad, grad_sum, h, mean, rstd, weight, ctx.normalized_shape, ctx.rms, need_weight, need_bias
        )
    # x + residual: both take grad_h (x in its own dtype when the residual stream is float32)
    grad_x = grad_h.to(ctx.x_dtype) if need_x and grad_h is not None else None
    grad_residual = grad_h if need_residual else None
    weight_dtype, bias_dtype = ctx.param_dtypes
    return (
        grad_x,
        grad_residual,
        None,
        grad_weight.to(weight_dtype) if need_weight and grad_weight is not None else None,
        grad_bias.to(bias_dtype) if need_bias and grad_bias is not None else None,
        None,
        None,
    )


norm_fwd = register_autograd("norm_fwd", _backward, _setup)


# ---- the public ops: composites over norm_fwd ----
def default_eps(x, eps):
    """eps=None as torch's rms_norm: the machine epsilon of the math type (float32 for 16-bit x)."""
    return torch.finfo(math_dtype(x)).eps if eps is None else eps


def residual_stream(op, x, residual, residual_dtype):
    """residual in the residual stream's dtype (residual_dtype, else residual's own): x's, or float32 for 16-bit
    x; a residual in x's dtype is widened when the stream is float32 (the first block of a float32 stream)."""
    _checks.check_floating(op, "x", x)
    _checks.check_floating(op, "residual", residual)
    dtype = residual_dtype or residual.dtype
    if not residual_dtype_ok(x.dtype, dtype):
        what = f"residual_dtype {dtype}" if residual_dtype else f"residual has dtype {dtype}"
        raise RuntimeError(
            f"fused.{op}: {what} but x has dtype {x.dtype} (the residual stream takes x's dtype, or "
            "float32 for 16-bit x)"
        )
    if residual.dtype != dtype:
        if residual.dtype != x.dtype:
            raise RuntimeError(
                f"fused.{op}: residual has dtype {residual.dtype}, neither x's ({x.dtype}) nor residual_dtype ({dtype})"
            )
        residual = residual.to(dtype)
    return residual


def _rms_norm(x, normalized_shape, weight=None, eps=None):
    _checks.check_floating("rms_norm", "x", x)
    x, weight = autocast_float32("norm", x, weight)
    return norm_fwd(x, None, normalized_shape, weight, None, default_eps(x, eps), True)[0]


def _layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    x, weight, bias = autocast_float32("norm", x, weight, bias)
    return norm_fwd(x, None, normalized_shape, weight, bias, eps, False)[0]


def _add_rms_norm(x, residual, normalized_shape, weight=None, eps=None, *, residual_dtype=None):
    residual = residual_stream("add_rms_norm", x, residual, residual_dtype)
    out, total, _, _ = norm_fwd(x, residual, normalized_shape, weight, None, default_eps(x, eps), True)
    return out, total


def _add_layer_norm(x, residual, normalized_shape, weight=None, bias=None, eps=1e-5, *, residual_dtype=None):
    residual = residual_stream("add_layer_norm", x, residual, residual_dtype)
    out, total, _, _ = norm_fwd(x, residual, normalized_shape, weight, bias, eps, False)
    return out, total


_lib = torch.library.Library("fused", "IMPL")
_COMPOSITES = {
    "rms_norm": _rms_norm,
    "layer_norm": _layer_norm,
    "add_rms_norm": _add_rms_norm,
    "add_layer_norm": _add_layer_norm,
}
for _name, _fn in _COMPOSITES.items():
    _lib.impl(_name, _fn, "CompositeImplicitAutograd")
rms_norm, layer_norm, add_rms_norm, add_layer_norm = (public(n, f) for n, f in _COMPOSITES.items())


# ---- CUDA tensors: CUDA C++ (fused::cuda_<op>, when compiled) or Triton ----
for _op in ("norm_fwd", "norm_backward"):
    register_gpu(_op, cuda_op=f"cuda_{_op}", triton=f"{TRITON}:{_op}")
