"""Registration of the cross-entropy losses: the public composites (argument checks, flattening), their drivers
over the chunked "linear + row kernel" machinery (fused/loss/chunked.py), fake kernels (torch.compile), autograd,
and the CUDA-device routing of the row kernel fused::cross_entropy_rows between CUDA C++ and Triton.

The row kernel computes loss, logsumexp and the gradient of the logits (written over them), all in fp32. For
reduction "mean" and "sum" the gradients are computed in forward whenever autograd will want them, and the
backward only multiplies them by grad_output, in place (3 GEMMs in all, as eager); "none" needs a gradient per
row, so its backward runs the chunks again, as does a second backward through the same graph.
"""

import torch
import torch.nn.functional as F

from fused import _checks
from fused._autocast import autocast_enabled, autocast_linear
from fused._autograd import register_autograd
from fused._backend import register_gpu
from fused.loss import chunked
from fused.loss.chunked import check_linear, math_dtype  # noqa: F401  (math_dtype: the Triton launchers')

TRITON = "fused.loss.triton_kernels"
REDUCTIONS = ("none", "mean", "sum")


# ---- argument checks (public ops; the fake kernels and Triton launchers reuse them) ----
def check_reduction(op, reduction):
    if reduction not in REDUCTIONS:
        raise ValueError(f"fused.{op}: reduction must be 'none', 'mean' or 'sum', got {reduction!r}")


def check_options(op, reduction, label_smoothing, z_loss, softcap):
    check_reduction(op, reduction)
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"fused.{op}: label_smoothing must be in [0, 1], got {label_smoothing}")
    if not z_loss >= 0.0:
        raise ValueError(f"fused.{op}: z_loss must be >= 0, got {z_loss}")
    if softcap is not None and not softcap > 0.0:
        raise ValueError(f"fused.{op}: softcap must be > 0 (or None), got {softcap}")


def check_target(op, target, shape, ref, logits_shape):
    """Class indices: int64 (or uint8, as torch takes) of `shape`, on ref's device."""
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"fused.{op}: target must be a tensor, got {type(target).__name__}")
    if target.is_floating_point():
        raise RuntimeError(
            f"fused.{op}: target must hold class indices (int64); class-probability targets (a "
            f"float tensor of shape {tuple(logits_shape)}) are not supported, got {target.dtype} "
            f"of shape {tuple(target.shape)}"
        )
    if target.dtype not in (torch.int64, torch.uint8):
        raise RuntimeError(f"fused.{op}: target must hold int64 (or uint8) class indices, got {target.dtype}")
    check_target_layout(op, target, shape, ref, "target must have shape {} (one class index per row of logits)")


def check_target_layout(op, target, shape, ref, rule):
    """target on ref's device and of `shape`; `rule` words the shape's requirement ({}: the shape)."""
    if target.device != ref.device:
        raise RuntimeError(f"fused.{op}: target is on {target.device} but the logits are on {ref.device}")
    if tuple(target.shape) != tuple(shape):
        raise ValueError(f"fused.{op}: {rule.format(tuple(shape))}, got {tuple(target.shape)}")


def check_target_range(op, target, classes, ignore_index):
    """CPU: an out-of-range target is an IndexError naming the op, as in torch (a GPU would need a sync: its
    kernels give that row NaN instead). Traced calls (torch.compile, fake or functional tensors, torch.func
    transforms) leave it to the row kernel: no data-dependent branch."""
    if target.device.type != "cpu" or not _checks.values_readable(target):
        return
    bad = (target != ignore_index) & ((target < 0) | (target >= classes))
    if bad.any():
        raise IndexError(
            f"fused.{op}: target {target[bad][0].item()} is out of bounds for {classes} classes "
            f"(ignore_index is {ignore_index})"
        )


def check_class_weight(op, weight, ref, classes):
    _checks.check_floating(op, "weight", weight)
    if weight.device != ref.device:
        raise RuntimeError(f"fused.{op}: weight is on {weight.device} but the logits are on {ref.device}")
    if weight.dim() != 1 or weight.shape[0] != classes:
        raise RuntimeError(
            f"fused.{op}: weight must be 1-D with {classes} entries (one per class), got shape {tuple(weight.shape)}"
        )


def check_linear_cross_entropy(op, input, linear_weight, target, linear_bias, weight):
    check_linear(op, input, linear_weight, linear_bias)
    classes = linear_weight.shape[0]
    check_target(op, target, input.shape[:-1], input, (*input.shape[:-1], classes))
    if weight is not None:
        check_class_weight(op, weight, input, classes)


def check_logits(op, logits, target, weight):
    """logits (C), (N, C) or (N, C, d1, ...) with target (), (N) or (N, d1, ...), as F.cross_entropy."""
    _checks.check_floating(op, "logits", logits)
    if logits.dim() < 1:
        raise RuntimeError(f"fused.{op}: logits must have at least 1 dimension (the classes), got a scalar")
    class_dim = min(1, logits.dim() - 1)
    check_target(op, target, logits.shape[:class_dim] + logits.shape[class_dim + 1 :], logits, logits.shape)
    if weight is not None:
        check_class_weight(op, weight, logits, logits.shape[class_dim])


def check_rows(op, logits, target, weight, scale, grad, label_smoothing, softcap):
    """fused::cross_entropy_rows' arguments, as csrc/loss/loss_args.h checks them."""
    _checks.check_floating(op, "logits", logits)
    if logits.dim() != 2:
        raise RuntimeError(f"fused.{op}: logits must be 2-D [rows, classes], got shape {tuple(logits.shape)}")
    rows, classes = logits.shape
    if target.dtype != torch.int64 or target.shape != (rows,) or target.device != logits.device:
        raise RuntimeError(
            f"fused.{op}: target must be int64 of shape ({rows},) on {logits.device}, got "
            f"{target.dtype} of shape {tuple(target.shape)} on {target.device}"
        )
    acc = math_dtype(logits)
    if weight is not None and (weight.shape != (classes,) or weight.dtype != acc or weight.device != logits.device):
        raise RuntimeError(
            f"fused.{op}: weight must be {acc} of shape ({classes},) on {logits.device}, got "
            f"{weight.dtype} of shape {tuple(weight.shape)} on {weight.device}"
        )
    if scale.dtype != acc or scale.device != logits.device or tuple(scale.shape) not in ((2,), (rows, 2)):
        raise RuntimeError(f"fused.{op}: scale must be {acc} of shape (2,) or ({rows}, 2) on {logits.device}")
    if grad.numel():
        _checks.check_like(op, "grad", grad, "logits", logits)
        if grad.shape != logits.shape or (classes > 1 and grad.stride(1) != 1):
            raise RuntimeError(
                f"fused.{op}: grad must be empty (no gradient) or have the shape of logits with unit "
                f"column stride, got shape {tuple(grad.shape)} and strides {grad.stride()}"
            )
    if not 0.0 <= label_smoothing <= 1.0:
        raise RuntimeError(f"fused.{op}: label_smoothing must be in [0, 1], got {label_smoothing}")
    if not softcap >= 0.0:
        raise RuntimeError(f"fused.{op}: softcap must be > 0 (0 here: none), got {softcap}")


# ---- the pieces shared by both ops ----
def row_scales(target, class_weight, reduction, ignore_index, dtype):
    """(scale, denominators): cross_entropy_rows' scale for a grad_output of 1, and for a mean the two
    denominators, the summed class weight and the count of the non-ignored targets (device tensors, no sync)."""
    if reduction != "mean":
        return torch.ones(2, dtype=dtype, device=target.device), None
    valid = target != ignore_index
    count = valid.sum().to(dtype)
    if class_weight is None:
        weight_sum = count
    else:  # (out-of-range targets are clamped here; the row kernel reports them)
        weight_sum = torch.where(valid, class_weight[target.clamp(0, max(class_weight.shape[0] - 1, 0))], 0).sum()
    return torch.stack([1 / weight_sum, 1 / count]), (weight_sum, count)


def reduce_loss(loss_rows, lse, z_loss, reduction, denominators):
    """The loss from the row kernel's outputs (lse is 0 on ignored rows, so their z-loss term is 0)."""
    z = z_loss * lse.square() if z_loss else None
    if reduction == "none":
        return loss_rows if z is None else loss_rows + z
    if reduction == "sum":
        return loss_rows.sum() if z is None else loss_rows.sum() + z.sum()
    weight_sum, count = denominators
    # torch's weighted mean is nan when the targets' weights sum to 0 (0 / 0), label smoothing or not
    ce = torch.where(weight_sum == 0, torch.nan, loss_rows.sum()) / weight_sum
    return ce if z is None else ce + z.sum() / count


def backward_scale(grad_loss, target, class_weight, reduction, ignore_index, dtype):
    """cross_entropy_rows' scale for a backward: grad_output[row] for both parts of each row's loss ("none"), or
    grad_output times the scale of the reduction."""
    g = grad_loss.to(dtype)
    if reduction == "none":
        return torch.stack([g, g], dim=1)
    return row_scales(target, class_weight, reduction, ignore_index, dtype)[0] * g


def _chunks(input, linear_weight, target, linear_bias, class_weight, scale, row_options, grads):
    """(loss rows, lse rows, grad_input, grad_weight, grad_bias) of sum_r (scale[r, 0] loss_r + scale[r, 1] z-loss_r).
    row_options: the row kernel's (ignore_index, label_smoothing, z_loss, softcap)."""
    need_grad = any(grads)

    def rows(logits, r0, r1, _teacher):
        return torch.ops.fused.cross_entropy_rows(
            logits,
            target[r0:r1],
            class_weight,
            scale if scale.dim() == 1 else scale[r0:r1],
            logits if need_grad else logits.new_empty(0),
            *row_options,
        )

    return chunked.linear_chunks(input, linear_weight, linear_bias, rows, 2, grads)


def class_weight_in(weight, like):
    return None if weight is None else weight.to(math_dtype(like)).contiguous()


# ---- kernels of the internal ops (CPU and CUDA: the GEMMs are ATen's, the row kernel is routed per device) ----
def _linear_cross_entropy_fwd(input, linear_weight, target, linear_bias, weight, reduction, *options):
    """options: (ignore_index, label_smoothing, z_loss, softcap, grad_input, grad_weight, grad_bias), the schema's."""
    row_options, grads = options[:4], options[4:]
    ignore_index, z_loss = row_options[0], row_options[2]
    acc = math_dtype(input)
    class_weight = class_weight_in(weight, input)
    scale, denominators = row_scales(target, class_weight, reduction, ignore_index, acc)
    if reduction == "none":
        grads = (False, False, False)
    loss_rows, lse, gi, gw, gb = _chunks(
        input, linear_weight, target, linear_bias, class_weight, scale, row_options, grads
    )
    return reduce_loss(loss_rows, lse, z_loss, reduction, denominators), gi, gw, gb


def _linear_cross_entropy_bwd(grad_loss, input, linear_weight, target, linear_bias, weight, reduction, *options):
    row_options, grads = options[:4], options[4:]
    class_weight = class_weight_in(weight, input)
    scale = backward_scale(grad_loss, target, class_weight, reduction, row_options[0], math_dtype(input))
    return _chunks(input, linear_weight, target, linear_bias, class_weight, scale, row_options, grads)[2:]


def _cross_entropy_fwd(logits, target, weight, reduction, ignore_index, label_smoothing, z_loss, softcap, grad):
    acc = math_dtype(logits)
    class_weight = class_weight_in(weight, logits)
    scale, denominators = row_scales(target, class_weight, reduction, ignore_index, acc)
    grad_logits = logits.new_empty(logits.shape) if grad and reduction != "none" else logits.new_empty(0)
    loss_rows, lse = torch.ops.fused.cross_entropy_rows(
        logits, target, class_weight, scale, grad_logits, ignore_index, label_smoothing, z_loss, softcap
    )
    return reduce_loss(loss_rows, lse, z_loss, reduction, denominators), grad_logits


def _cross_entropy_bwd(grad_loss, logits, target, weight, reduction, ignore_index, label_smoothing, z_loss, softcap):
    class_weight = class_weight_in(weight, logits)
    scale = backward_scale(grad_loss, target, class_weight, reduction, ignore_index, math_dtype(logits))
    grad_logits = logits.new_empty(logits.shape)
    torch.ops.fused.cross_entropy_rows(
        logits, target, class_weight, scale, grad_logits, ignore_index, label_smoothing, z_loss, softcap
    )
    return grad_logits


chunked.register_kernels(
    linear_cross_entropy_fwd=_linear_cross_entropy_fwd,
    linear_cross_entropy_bwd=_linear_cross_entropy_bwd,
    cross_entropy_fwd=_cross_entropy_fwd,
    cross_entropy_bwd=_cross_entropy_bwd,
)


# ---- fake kernels ----
def _loss_shape(reduction, n):
    return (n,) if reduction == "none" else ()


@torch.library.register_fake("fused::cross_entropy_rows")
def _(logits, target, weight, scale, grad, ignore_index, label_smoothing, z_loss, softcap):
    check_rows("cross_entropy_rows", logits, target, weight, scale, grad, label_smoothing, softcap)
    rows = logits.shape[0]
    return logits.new_empty(rows, dtype=math_dtype(logits)), logits.new_empty(rows, dtype=math_dtype(logits))


@torch.library.register_fake("fused::linear_cross_entropy_fwd")
def _(input, linear_weight, target, linear_bias, weight, reduction, *options):
    check_linear_cross_entropy("linear_cross_entropy", input, linear_weight, target, linear_bias, weight)
    grads = reduction != "none"
    grad_input, grad_weight, grad_bias = options[4:]
    return (
        input.new_empty(_loss_shape(reduction, input.shape[0]), dtype=math_dtype(input)),
        input.new_empty(input.shape if grads and grad_input else (0,)),
        linear_weight.new_empty(linear_weight.shape if grads and grad_weight else (0,)),
        linear_weight.new_empty(linear_weight.shape[:1] if grads and grad_bias and linear_bias is not None else (0,)),
    )


@torch.library.register_fake("fused::linear_cross_entropy_bwd")
def _(grad_loss, input, linear_weight, target, linear_bias, weight, reduction, *options):
    grad_input, grad_weight, grad_bias = options[4:]
    return (
        input.new_empty(input.shape if grad_input else (0,)),
        linear_weight.new_empty(linear_weight.shape if grad_weight else (0,)),
        linear_weight.new_empty(linear_weight.shape[:1] if grad_bias and linear_bias is not None else (0,)),
    )


@torch.library.register_fake("fused::cross_entropy_fwd")
def _(logits, target, weight, reduction, ignore_index, label_smoothing, z_loss, softcap, grad):
    check_logits("cross_entropy", logits, target, weight)
    return (
        logits.new_empty(_loss_shape(reduction, logits.shape[0]), dtype=math_dtype(logits)),
        logits.new_empty(logits.shape if grad and reduction != "none" else (0,)),
    )


@torch.library.register_fake("fused::cross_entropy_bwd")
def _(grad_loss, logits, target, weight, reduction, ignore_index, label_smoothing, z_loss, softcap):
    return logits.new_empty(logits.shape)


# ---- autograd: the first backward of "mean" / "sum" scales forward's gradients; otherwise the backward ops ----
def _lce_setup(ctx, inputs, output):
    input, linear_weight, target, linear_bias, weight, reduction, *options = inputs
    grad_input, grad_weight, grad_bias = options[4:]
    chunked.setup_forward_grads(
        ctx,
        (input, linear_weight, target, linear_bias, weight),
        reduction,
        options[:4],
        output[1:],
        (grad_input, grad_weight, grad_bias and linear_bias is not None),
    )


def _lce_backward(ctx, grad_loss, *_):
    need_input, need_weight, _target, need_bias = ctx.needs_input_grad[:4]
    grads = None if grad_loss is None else chunked.forward_grads(ctx, grad_loss, (need_input, need_weight, need_bias))
    if grads is None and grad_loss is not None:
        grads = torch.ops.fused.linear_cross_entropy_bwd(
            grad_loss, *ctx.saved_tensors, *ctx.options, need_input, need_weight, need_bias
        )
    gi, gw, gb = grads or (None, None, None)
    return (gi if need_input else None, gw if need_weight else None, None, gb if need_bias else None, *([None] * 9))


linear_cross_entropy_fwd = register_autograd("linear_cross_entropy_fwd", _lce_backward, _lce_setup)


def _ce_setup(ctx, inputs, output):
    logits, target, weight, reduction, *options = inputs
    chunked.setup_forward_grads(ctx, (logits, target, weight), reduction, options[:4], output[1:], (options[4],))


def _ce_backward(ctx, grad_loss, _grad_logits_output):
    grad = None
    if grad_loss is not None and ctx.needs_input_grad[0]:
        grad = chunked.forward_grads(ctx, grad_loss, (True,))
        grad = grad[0] if grad else torch.ops.fused.cross_entropy_bwd(grad_loss, *ctx.saved_tensors, *ctx.options)
    return (grad, *([None] * 8))


cross_entropy_fwd = register_autograd("cross_entropy_fwd", _ce_backward, _ce_setup)


# ---- the public composites ----
def _loss_dtype(loss, like):
    """The input's dtype, or float32 under autocast (torch runs cross-entropy in float32 there)."""
    return loss if autocast_enabled(like.device.type) else loss.to(like.dtype)


def _row_options(op, reduction, ignore_index, label_smoothing, z_loss, softcap):
    """The options, checked, as the internal ops take them: (reduction, ignore_index, label_smoothing, z_loss,
    softcap), softcap 0 for none."""
    check_options(op, reduction, label_smoothing, z_loss, softcap)
    return reduction, ignore_index, float(label_smoothing), float(z_loss), float(softcap or 0.0)


def _probabilities(target):
    return isinstance(target, torch.Tensor) and target.is_floating_point()


def _linear_cross_entropy(input, linear_weight, target, **options):
    op = "linear_cross_entropy"
    linear_bias, weight, reduction, ignore_index, label_smoothing, z_loss, softcap = chunked.keyword_options(
        op, options
    )
    if _probabilities(target) and ignore_index not in (None, -100):
        raise RuntimeError(f"fused.{op}: ignore_index cannot be given with class-probability targets")
    ignore_index = -100 if ignore_index is None else ignore_index
    row_options = _row_options(op, reduction, ignore_index, label_smoothing, z_loss, softcap)
    input, linear_weight, linear_bias = autocast_linear(input, linear_weight, linear_bias)
    if isinstance(linear_weight, torch.Tensor) and linear_weight.dim() < 2:
        raise RuntimeError(
            f"fused.{op}: linear_weight must be [classes, in_features] (or [classes, d1, ..., in_features]), got "
            f"shape {tuple(linear_weight.shape)}"
        )
    if _probabilities(target) or (isinstance(linear_weight, torch.Tensor) and linear_weight.dim() > 2):
        return _dense_linear_cross_entropy(op, input, linear_weight, target, linear_bias, weight, *row_options)
    check_linear_cross_entropy(op, input, linear_weight, target, linear_bias, weight)
    target = target.reshape(-1).long()
    check_target_range(op, target, linear_weight.shape[0], ignore_index)
    grads = chunked.needs_grad(input, linear_weight, linear_bias) if reduction != "none" else [False] * 3
    loss = linear_cross_entropy_fwd(
        input.reshape(-1, input.shape[-1]), linear_weight, target, linear_bias, weight, *row_options, *grads
    )[0]
    loss = _loss_dtype(loss, input)
    return loss.view(input.shape[:-1]) if reduction == "none" else loss


def _dense_linear_cross_entropy(op, input, linear_weight, target, linear_bias, weight, *row_options):
    """Class-probability targets, or a K-dimensional linear_weight [C, d1, ..., dK, D] (logits [N, C, d1, ...]):
    cross_entropy of the whole logits of F.linear, as torch's chunked F.linear_cross_entropy falls back to (a
    probability target is as large as the logits)."""
    check_linear(op, input, linear_weight.flatten(0, -2) if linear_weight.dim() > 2 else linear_weight, None)
    out_features = tuple(linear_weight.shape[1:-1])
    if out_features and input.dim() != 2:
        raise RuntimeError(
            f"fused.{op}: a K-dimensional linear_weight of shape {tuple(linear_weight.shape)} needs input of shape "
            f"[N, {input.shape[-1]}], got {tuple(input.shape)}"
        )
    if linear_bias is not None:
        _checks.check_like(op, "linear_bias", linear_bias, "input", input)
        if linear_bias.shape != linear_weight.shape[:-1]:
            raise RuntimeError(
                f"fused.{op}: linear_bias must have shape {tuple(linear_weight.shape[:-1])} (linear_weight's but "
                f"the last), got {tuple(linear_bias.shape)}"
            )
    classes, batch = linear_weight.shape[0], input.shape[:-1]
    logits_shape = (*batch, classes, *out_features)
    if _probabilities(target):
        check_probabilities(op, target, logits_shape, input)
    else:
        check_target(op, target, (*batch, *out_features), input, logits_shape)
    bias = None if linear_bias is None else linear_bias.flatten()
    logits = F.linear(input, linear_weight.flatten(0, -2), bias).view(logits_shape)
    if len(batch) > 1:  # [..., C]: rows of classes (out_features is empty here)
        logits, target = logits.flatten(0, -2), target.flatten(0, -2 if _probabilities(target) else -1)
    loss = _cross_entropy_of(op, logits, target, weight, *row_options)
    return loss.view(batch) if row_options[0] == "none" and len(batch) > 1 else loss


def check_probabilities(op, target, shape, ref):
    """A class-probability target: floating point, of the logits' shape, on ref's device."""
    rule = "a class-probability target (floating point) must have the logits' shape {}"
    check_target_layout(op, target, shape, ref, rule)


def _probability_cross_entropy(op, logits, target, weight, reduction, ignore_index, label_smoothing, z_loss, softcap):
    """Class-probability targets: F.cross_entropy on the (capped) logits, which are dense as the target is, plus
    the z-loss of every token (no target is ignored)."""
    _checks.check_floating(op, "logits", logits)
    if logits.dim() < 1:
        raise RuntimeError(f"fused.{op}: logits must have at least 1 dimension (the classes), got a scalar")
    class_dim = min(1, logits.dim() - 1)
    check_probabilities(op, target, logits.shape, logits)
    if ignore_index >= 0:
        raise RuntimeError(f"fused.{op}: ignore_index is not supported with class-probability targets")
    if weight is not None:
        check_class_weight(op, weight, logits, logits.shape[class_dim])
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    loss = F.cross_entropy(logits, target, weight=weight, reduction=reduction, label_smoothing=label_smoothing)
    if z_loss:
        z = z_loss * torch.logsumexp(logits, dim=class_dim).square()
        loss = loss + (z if reduction == "none" else z.sum() if reduction == "sum" else z.mean())
    return loss


def _cross_entropy(logits, target, **options):
    op = "cross_entropy"
    weight, reduction, ignore_index, label_smoothing, z_loss, softcap = chunked.keyword_options(op, options)
    row_options = _row_options(op, reduction, ignore_index, label_smoothing, z_loss, softcap)
    return _cross_entropy_of(op, logits, target, weight, *row_options)


def _cross_entropy_of(op, logits, target, weight, *row_options):
    """cross_entropy of given logits, its errors naming `op`."""
    if _probabilities(target):
        return _probability_cross_entropy(op, logits, target, weight, *row_options)
    check_logits(op, logits, target, weight)
    classes = logits.shape[min(1, logits.dim() - 1)]
    rows = logits.movedim(1, -1) if logits.dim() > 2 else logits  # (N, C, d1, ...): classes last (a copy)
    rows = rows.reshape(target.numel(), classes)  # (-1 cannot size it when classes is 0)
    if rows.stride(-1) != 1 and classes > 1:
        rows = rows.contiguous()
    flat_target = target.reshape(-1).long()
    check_target_range(op, flat_target, classes, row_options[1])
    grad = chunked.needs_grad(logits)[0] and row_options[0] != "none"
    loss = cross_entropy_fwd(rows, flat_target, weight, *row_options, grad)[0]
    loss = _loss_dtype(loss, logits)
    return loss.view(target.shape) if row_options[0] == "none" else loss


_lib = torch.library.Library("fused", "IMPL")
_lib.impl("linear_cross_entropy", _linear_cross_entropy, "CompositeImplicitAutograd")
_lib.impl("cross_entropy", _cross_entropy, "CompositeImplicitAutograd")


# ---- CUDA tensors: the row kernel in CUDA C++ (fused::cuda_cross_entropy_rows, when compiled) or Triton ----
register_gpu("cross_entropy_rows", cuda_op="cuda_cross_entropy_rows", triton=f"{TRITON}:cross_entropy_rows")
