"""fused.clip_grad_norm_: a drop-in for torch.nn.utils.clip_grad_norm_ in two passes (the norm with the finite
check, then grads *= clip coefficient), whatever the number of tensors, with no host sync."""

import math
import types
import warnings

import torch

from fused.optim import ops  # noqa: F401  fake kernels and GPU routing
from fused.optim.functional import check_grads, check_one_device, global_norm, is_dense, local, norm_dtype


def _check_args(max_norm, norm_type):
    """(max_norm, norm_type) as floats, as torch takes them (norm_type may be a string such as 'inf'). A negative
    or NaN max_norm is refused: torch would scale by a negative or NaN coefficient."""
    max_norm, norm_type = float(max_norm), float(norm_type)
    if not max_norm >= 0:
        raise ValueError(f"fused.clip_grad_norm_: max_norm must be >= 0, got {max_norm}")
    return max_norm, norm_type


def _nonfinite_error(norm_type):
    return RuntimeError(
        f"fused.clip_grad_norm_: The total norm of order {norm_type} for gradients from `parameters` "
        "is non-finite, so it cannot be clipped. To disable this error and scale the gradients by the "
        "non-finite norm anyway, set `error_if_nonfinite=False`"
    )


def _torch_clip(grads, max_norm, norm_type, error_if_nonfinite, foreach):
    """Orders that are not norms (0 counts the gradients with a nonzero entry, negative orders, NaN): torch's own
    definition (per-tensor norms, then their norm), by torch's own code."""
    norm = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.device))
    return norm


def _clip_grads(grads, max_norm, norm_type, error_if_nonfinite=False, foreach=None):
    """The two passes over `grads` (plain tensors or DTensor shards): norm + finite check, then the scaling.
    Gradients that are not dense in memory (strided views) go through a dense copy, written back."""
    if not norm_type > 0:
        return _torch_clip(grads, max_norm, norm_type, error_if_nonfinite, foreach)
    if not grads:
        return torch.tensor(0.0)
    check_grads("clip_grad_norm_", grads, written=True)
    check_one_device("clip_grad_norm_", grads)
    tensors = [local(g) for g in grads]
    dense = [t if is_dense(t) else t.contiguous() for t in tensors]
    norm, coef, _ = global_norm(grads, None, None, norm_type, max_norm, None, dense)
    if error_if_nonfinite and not math.isfinite(norm.item()):
        raise _nonfinite_error(norm_type)
    torch.ops.fused.scale_grads_(dense, coef)
    for t, d in zip(tensors, dense):
        if d is not t:
            t.copy_(d)
    return norm


def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    """Scales the gradients of `parameters` so that their global norm is at most max_norm; returns the total
    norm before clipping, a device tensor in the gradients' dtype, as torch's. norm_type: any p > 0 or inf (or
    'inf'); other orders, which are not norms, run torch's definition. foreach is taken as torch takes it (the
    fused kernels run either way). error_if_nonfinite=True reads the norm on the host (a sync), as torch does.
    Warnings and errors as torch's: an empty generator warns that nothing is clipped."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    else:
        is_generator = isinstance(parameters, types.GeneratorType)
        parameters = list(parameters)  # a generator is read once
        if is_generator and not parameters:
            warnings.warn("`parameters` is an empty generator, no gradient clipping will occur.", stacklevel=2)
    grads = [p.grad for p in parameters if p.grad is not None]
    max_norm, norm_type = _check_args(max_norm, norm_type)
    return _clip_grads(grads, max_norm, norm_type, error_if_nonfinite, foreach)


# torch.ops.fused.clip_grad_norm_ takes the gradients themselves (an op cannot take an iterable of parameters).
_lib = torch.library.Library("fused", "FRAGMENT")
_lib.define("clip_grad_norm_(Tensor(a!)[] grads, float max_norm, float norm_type=2.0) -> Tensor")


def _clip_grad_norm_op(grads, max_norm, norm_type=2.0):
    return _clip_grads(list(grads), *_check_args(max_norm, norm_type))


_lib.impl("clip_grad_norm_", _clip_grad_norm_op, "CompositeExplicitAutograd")


@torch.library.register_fake("fused::clip_grad_norm_")
def _(grads, max_norm, norm_type=2.0):
    _check_args(max_norm, norm_type)
    return grads[0].new_empty((), dtype=norm_dtype(grads)) if len(grads) else torch.empty(())
