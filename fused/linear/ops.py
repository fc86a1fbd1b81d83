"""Registration of the fused linear ops: the public composite linear_act, fake kernels (torch.compile),
autograd (backward made of fused ops and matmuls), and the CUDA-device routing between CUDA C++ and Triton."""

import math

import torch

from fused import _checks
from fused._autocast import autocast_linear
from fused._autograd import public, register_autograd
from fused._backend import register_gpu
from fused._codes import ACT_CODES
from fused.elementwise.ops import bias_act

TRITON = "fused.linear.triton_kernels"
# relu, sigmoid and tanh differentiate from their output, as eager autograd does (act_grad_from_saved in
# csrc/linear/linear_math.h); every other activation but identity needs the pre-activation saved.
GRAD_FROM_OUTPUT = ("relu", "sigmoid", "tanh")
NEEDS_PRE = tuple(act for act in ACT_CODES if act != "identity" and act not in GRAD_FROM_OUTPUT)


def check_linear(op, x, weight, bias, act):
    _checks.check_act(op, act)
    _checks.check_floating(op, "x", x)
    _checks.check_like(op, "weight", weight, "x", x)
    if x.dim() < 1:
        raise RuntimeError(f"fused.{op}: x must have at least 1 dimension, got a scalar")
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise RuntimeError(
            f"fused.{op}: weight must be 2-D [out_features, in_features] with in_features == "
            f"x.size(-1), got weight of shape {tuple(weight.shape)} for x of shape {tuple(x.shape)}"
        )
    if bias is not None:
        _checks.check_like(op, "bias", bias, "x", x)
        if bias.dim() != 1 or bias.shape[0] != weight.shape[0]:
            raise RuntimeError(
                f"fused.{op}: bias must be 1-D with out_features = weight.size(0) entries, got "
                f"bias of shape {tuple(bias.shape)} for weight of shape {tuple(weight.shape)}"
            )


def check_grad_pre(op, grad, saved, act):
    _checks.check_act(op, act)
    _checks.check_floating(op, "grad", grad)
    _checks.check_like(op, "saved", saved, "grad", grad)
    _checks.check_same_shape(op, "grad", grad, "saved", saved)
    if grad.dim() < 1:
        raise RuntimeError(f"fused.{op}: grad must have at least 1 dimension")


# ---- fake kernels ----
@torch.library.register_fake("fused::linear_act_fwd")
def _(x, weight, bias, act, save_pre):
    check_linear("linear_act", x, weight, bias, act)
    shape = (*x.shape[:-1], weight.shape[0])
    pre = x.new_empty(shape) if save_pre and act in NEEDS_PRE else x.new_empty(0)
    return x.new_empty(shape), pre


@torch.library.register_fake("fused::linear_act_grad_pre")
def _(grad, saved, act, bias_grad):
    check_grad_pre("linear_act_grad_pre", grad, saved, act)
    return grad.new_empty(grad.shape), grad.new_empty(grad.shape[-1] if bias_grad else 0)


# ---- autograd of linear_act_fwd ----
def _setup(ctx, inputs, output):
    x, weight, bias, act, save_pre = inputs
    out, pre = output
    saved = None
    if act in NEEDS_PRE:
        saved = pre if save_pre else None  # None: not saved, recomputed in backward
    elif act != "identity":
        saved = out
    ctx.save_for_backward(x, weight, bias, saved)
    ctx.act = act
    # The pre-activation output is autograd's own saved value, not a result to differentiate; without these,
    # autograd would fill a zero gradient of the output's size for it on every backward.
    ctx.mark_non_differentiable(pre)
    ctx.set_materialize_grads(False)


def _backward(ctx, grad, _grad_pre_output):
    if grad is None:
        return None, None, None, None, None
    x, weight, bias, saved = ctx.saved_tensors
    need_x, need_weight, need_bias = ctx.needs_input_grad[:3]
    rows, n_out = math.prod(x.shape[:-1]), weight.shape[0]
    grad_x = grad_weight = grad_bias = None
    if ctx.act == "identity":
        grad_pre = grad
        if need_bias:
            grad_bias = grad.reshape(rows, n_out).sum(0)
    else:
        if saved is None:  # called with save_pre=False under autograd: recompute the pre-activation
            saved = linear_act_fwd(x, weight, bias, "identity", False)[0]
        grad_pre, grad_bias = torch.ops.fused.linear_act_grad_pre(grad, saved, ctx.act, need_bias)
    grad_pre = grad_pre.reshape(rows, n_out)
    if need_x:
        grad_x = torch.matmul(grad_pre, weight).view(x.shape)
    if need_weight:
        grad_weight = torch.matmul(grad_pre.t(), x.reshape(rows, x.shape[-1]))
    return grad_x, grad_weight, grad_bias if need_bias else None, None, None


linear_act_fwd = register_autograd("linear_act_fwd", _backward, _setup)


# ---- linear_act: saves the pre-activation only when autograd will need it ----
def _linear_act(x, weight, bias=None, act="identity"):
    x, weight, bias = autocast_linear(x, weight, bias)
    check_linear("linear_act", x, weight, bias, act)
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))
    if needs_grad and act in NEEDS_PRE and x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64):
        # Training on the CPU, where the fused op is a GEMM and then one pass anyway: the same GEMM and pass as two
        # autograd nodes (the same bits), so that backward frees the saved pre-activation and the incoming
        # gradient after the activation's pass, before the GEMMs, as eager Linear + activation does.
        pre = linear_act_fwd(x, weight, None, "identity", False)[0]
        return bias_act(pre, bias, act)
    return linear_act_fwd(x, weight, bias, act, needs_grad)[0]


_lib = torch.library.Library("fused", "IMPL")
_lib.impl("linear_act", _linear_act, "CompositeImplicitAutograd")
linear_act = public("linear_act", _linear_act)


# ---- CUDA tensors: CUDA C++ (cuBLAS GEMM + fused epilogue pass) or Triton (epilogue inside the GEMM) ----
for _op in ("linear_act_fwd", "linear_act_grad_pre"):
    register_gpu(_op, cuda_op=f"cuda_{_op}", triton=f"{TRITON}:{_op}")
