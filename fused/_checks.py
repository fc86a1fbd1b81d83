"""Argument checks in Python, for the fake kernels and the Triton path (the C++ kernels check the same in C++).
Every message names the op and the argument."""

import torch

from fused._codes import ACT_CODES

ACTS = tuple(ACT_CODES)


def check_device(op, t):
    if t.device.type not in ("cpu", "cuda", "meta"):
        raise RuntimeError(f"fused.{op}: tensors on {t.device.type} are not supported (CPU and CUDA only)")


def values_readable(t):
    """Whether t's values can be read on the host to check them: a plain tensor, not while torch.compile traces (fake
    or functional tensors) nor inside a torch.func transform (a batched or gradient-tracking wrapper, whose values
    cannot drive a Python branch). Elsewhere the kernels check the values themselves."""
    return (
        type(t) in (torch.Tensor, torch.nn.Parameter)
        and not torch.compiler.is_compiling()
        and not torch._C._functorch.is_functorch_wrapped_tensor(t)
    )


def check_tensor(op, name, t):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"fused.{op}: {name} must be a tensor, got {type(t).__name__}")


def check_same_device(op, name, t, ref_name, ref):
    if t.device != ref.device:
        raise RuntimeError(f"fused.{op}: {name} is on {t.device} but {ref_name} is on {ref.device}")


def check_floating(op, name, t):
    check_tensor(op, name, t)
    check_device(op, t)
    if not t.is_floating_point():
        raise RuntimeError(f"fused.{op}: {name} must be a floating-point tensor, got {t.dtype}")


def check_like(op, name, t, ref_name, ref):
    check_tensor(op, name, t)
    check_same_device(op, name, t, ref_name, ref)
    if t.dtype != ref.dtype:
        raise RuntimeError(f"fused.{op}: {name} has dtype {t.dtype} but {ref_name} has dtype {ref.dtype}")


def check_same_shape(op, name, t, ref_name, ref):
    if t.shape != ref.shape:
        raise RuntimeError(
            f"fused.{op}: {name} shape {tuple(t.shape)} does not match {ref_name} shape {tuple(ref.shape)}"
        )


def check_grad_like(op, grad, ref_name, ref):
    """The gradient of an output shaped like ref: ref's dtype, device and shape."""
    check_like(op, "grad", grad, ref_name, ref)
    check_same_shape(op, "grad", grad, ref_name, ref)


def check_bias(op, x, bias):
    check_like(op, "bias", bias, "x", x)
    if bias.dim() != 1 or x.dim() < 1 or bias.shape[0] != x.shape[-1]:
        raise RuntimeError(
            f"fused.{op}: bias must be 1-D with x.size(-1) entries, got bias of shape "
            f"{tuple(bias.shape)} for x of shape {tuple(x.shape)}"
        )


def check_act(op, act):
    if act not in ACTS:
        raise RuntimeError(f"fused.{op}: unknown act {act!r}; expected one of {', '.join(ACTS)}")
