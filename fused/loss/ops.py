"""Registration of the loss family: the public composites (argument checks, flattening), the chunked
linear + cross-entropy driver, fake kernels (torch.compile), autograd, and the CUDA-device routing of the row
kernel between CUDA C++ and Triton.

linear_cross_entropy runs the rows in chunks sized from a memory budget, never holding the N x V logits: per
chunk the logits GEMM into one reused buffer, the row kernel fused::cross_entropy_rows (loss, logsumexp and the
gradient of the logits, written over them, all in fp32), then the backward GEMMs (grad_input for the chunk's
rows; grad_weight and grad_bias accumulated in fp32). For reduction "mean" and "sum" the gradients are computed
in forward whenever autograd will want them, and the backward only multiplies them by grad_output, in place (3
GEMMs in all, as eager); "none" needs a gradient per row, so its backward runs the chunks again, as does a second
backward through the same graph.
"""

import torch

from fused import _checks
from fused._backend import register_gpu

TRITON = "fused.loss.triton_kernels"
REDUCTIONS = ("none", "mean", "sum")
# The logits of one chunk of rows take at most this, or a quarter of linear_weight's size when that is larger:
# a few hundred rows or more per chunk, so that the GEMMs stay efficient, for a fraction of the memory the weight
# (and in training its gradient) takes anyway. A 16-bit weight gradient is added into its fp32 accumulator once per
# chunk (12 bytes of memory traffic per weight element), so there a chunk may take the weight's whole size: a
# quarter of the chunks, for one more weight-sized buffer next to the 3 the gradient already takes.
CHUNK_BYTES = 64 * 2**20


def math_dtype(t):
    return torch.float64 if t.dtype == torch.float64 else torch.float32


# ---- argument checks (public ops; the fake kernels and Triton launchers reuse them) ----
def check_options(op, reduction, label_smoothing, z_loss, softcap):
    if reduction not in REDUCTIONS:
        raise ValueError(f"fused.{op}: reduction must be 'none', 'mean' or 'sum', got {reduction!r}")
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
    if target.device != ref.device:
        raise RuntimeError(f"fused.{op}: target is on {target.device} but the logits are on {ref.device}")
    if tuple(target.shape) != tuple(shape):
        raise ValueError(
            f"fused.{op}: target must have shape {tuple(shape)} (one class index per row of logits), "
            f"got {tuple(target.shape)}"
        )


def check_target_range(op, target, classes, ignore_index):
    """CPU: an out-of-range target is an IndexError naming the op, as in torch (a GPU would need a sync: its
    kernels give that row NaN instead). Traced calls (torch.compile, fake or functional tensors) leave it to the
    row kernel: no data-dependent branch."""
    if target.device.type != "cpu" or torch.compiler.is_compiling() or type(target) is not torch.Tensor:
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


def check_linear(op, input, linear_weight, linear_bias):
    _checks.check_floating(op, "input", input)
    _checks.check_like(op, "linear_weight", linear_weight, "input", input)
    if input.dim() < 1:
        raise RuntimeError(f"fused.{op}: input must have at least 1 dimension [..., in_features], got a scalar")
    if linear_weight.dim() != 2:
        raise RuntimeError(
            f"fused.{op}: linear_weight must be 2-D [classes, in_features], got shape "
            f"{tuple(linear_weight.shape)} (K-dimensional weights are not supported)"
        )
    if linear_weight.shape[1] != input.shape[-1]:
        raise RuntimeError(
            f"fused.{op}: linear_weight has in_features {linear_weight.shape[1]} but input has "
            f"{input.shape[-1]} (its last dimension)"
        )
    if linear_bias is not None:
        _checks.check_like(op, "linear_bias", linear_bias, "input", input)
        if linear_bias.dim() != 1 or linear_bias.shape[0] != linear_weight.shape[0]:
            raise RuntimeError(
                f"fused.{op}: linear_bias must be 1-D with {linear_weight.shape[0]} entries (one "
                f"per class), got shape {tuple(linear_bias.shape)}"
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
    return loss_rows.sum() / weight_sum if z is None else loss_rows.sum() / weight_sum + z.sum() / count


def backward_scale(grad_loss, target, class_weight, reduction, ignore_index, dtype):
    """cross_entropy_rows' scale for a backward: grad_output[row] for both parts of each row's loss ("none"), or
    grad_output times the scale of the reduction."""
    g = grad_loss.to(dtype)
    if reduction == "none":
        return torch.stack([g, g], dim=1)
    return row_scales(target, class_weight, reduction, ignore_index, dtype)[0] * g


def chunk_rows(n_rows, linear_weight, accumulates_16bit=False):
    weight_bytes = linear_weight.numel() * linear_weight.element_size()
    budget = max(CHUNK_BYTES, weight_bytes if accumulates_16bit else weight_bytes // 4)
    return max(1, min(n_rows, budget // max(1, linear_weight.shape[0] * linear_weight.element_size())))


def linear_chunks(input, linear_weight, target, linear_bias, class_weight, scale, row_options, grads):
    """(loss rows, lse rows, grad_input, grad_weight, grad_bias) of sum_r (scale[r, 0] loss_r + scale[r, 1] z-loss_r),
    chunk by chunk over the rows of input [N, D]. row_options: the row kernel's (ignore_index, label_smoothing,
    z_loss, softcap); grads: which of (grad_input, grad_weight, grad_bias) to compute, the others empty tensors."""
    grad_input, grad_weight, grad_bias = grads
    grad_bias = grad_bias and linear_bias is not None
    N, D = input.shape
    V = linear_weight.shape[0]
    acc = math_dtype(input)
    rows = chunk_rows(N, linear_weight, grad_weight and input.dtype != acc)
    logits = input.new_empty(min(rows, N), V)
    loss, lse = input.new_empty(N, dtype=acc), input.new_empty(N, dtype=acc)
    need_grad = grad_input or grad_weight or grad_bias
    gi = input.new_empty(N, D) if grad_input else input.new_empty(0)
    gw = input.new_zeros(V, D, dtype=acc) if grad_weight else input.new_empty(0)
    gb = input.new_zeros(V, dtype=acc) if grad_bias else input.new_empty(0)
    # 16-bit: the weight gradient of a chunk is a 16-bit GEMM (fp32 inside), added into gw in fp32 by slices of
    # classes, so that no V x D temporary is needed.
    slice_classes = max(1, CHUNK_BYTES // max(1, D * input.element_size()))
    for r0 in range(0, N, rows):
        r1 = min(N, r0 + rows)
        x, buf = input[r0:r1], logits[: r1 - r0]
        if linear_bias is None:
            torch.mm(x, linear_weight.t(), out=buf)
        else:
            torch.addmm(linear_bias, x, linear_weight.t(), out=buf)
        loss[r0:r1], lse[r0:r1] = torch.ops.fused.cross_entropy_rows(
            buf,
            target[r0:r1],
            class_weight,
            scale if scale.dim() == 1 else scale[r0:r1],
            buf if need_grad else logits.new_empty(0),
            *row_options,
        )
        if grad_input:
            torch.mm(buf, linear_weight, out=gi[r0:r1])
        if grad_weight:
            if buf.dtype == acc:
                gw.addmm_(buf.t(), x)
            else:
                for c0 in range(0, V, slice_classes):
                    gw[c0 : c0 + slice_classes] += torch.mm(buf[:, c0 : c0 + slice_classes].t(), x)
        if grad_bias:
            gb += buf.sum(0, dtype=acc)
    return loss, lse, gi, gw.to(linear_weight.dtype), gb.to(linear_weight.dtype)


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
    loss_rows, lse, gi, gw, gb = linear_chunks(
        input, linear_weight, target, linear_bias, class_weight, scale, row_options, grads
    )
    return reduce_loss(loss_rows, lse, z_loss, reduction, denominators), gi, gw, gb


def _linear_cross_entropy_bwd(grad_loss, input, linear_weight, target, linear_bias, weight, reduction, *options):
    row_options, grads = options[:4], options[4:]
    class_weight = class_weight_in(weight, input)
    scale = backward_scale(grad_loss, target, class_weight, reduction, row_options[0], math_dtype(input))
    return linear_chunks(input, linear_weight, target, linear_bias, class_weight, scale, row_options, grads)[2:]


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


def _plain(fn):
    """fn without autograd (it computes gradients itself; the backward ops have no autograd of their own) and
    without autocast (the composites cast their inputs; the GEMMs must run in the dtypes they are given)."""

    def run(*args):
        with torch.no_grad(), torch.autocast(args[0].device.type, enabled=False):
            return fn(*args)

    return run


for _name, _fn in (
    ("linear_cross_entropy_fwd", _linear_cross_entropy_fwd),
    ("linear_cross_entropy_bwd", _linear_cross_entropy_bwd),
    ("cross_entropy_fwd", _cross_entropy_fwd),
    ("cross_entropy_bwd", _cross_entropy_bwd),
):
    # Every device: ATen's GEMMs and the row kernel, routed per device.
    torch.library.impl(f"fused::{_name}", "CompositeExplicitAutograd", _plain(_fn))


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
def _setup(ctx, saved, reduction, options, grads, computed):
    ctx.save_for_backward(*saved)
    ctx.options = (reduction, *options)
    ctx.mark_non_differentiable(*grads)
    ctx.set_materialize_grads(False)
    ctx.grads, ctx.computed = (grads, computed) if reduction != "none" else (None, None)


def _forward_grads(ctx, grad_loss, needed):
    """Forward's gradients times grad_output, or None when forward has none for this backward. They are consumed:
    scaled in place and handed to autograd, which takes them as .grad without a copy; a later backward through
    the same graph (retain_graph, gradcheck) recomputes them with the backward op."""
    grads, ctx.grads = ctx.grads, None
    if grads is None or any(need and not done for need, done in zip(needed, ctx.computed)):
        return None
    # In place on plain tensors (eager); out of place when traced (torch.compile's fake and functional tensors).
    in_place = type(grad_loss) is torch.Tensor and all(type(g) is torch.Tensor for g in grads)
    return [g.mul_(grad_loss) if in_place else g * grad_loss for g in grads]


def _lce_setup(ctx, inputs, output):
    input, linear_weight, target, linear_bias, weight, reduction, *options = inputs
    grad_input, grad_weight, grad_bias = options[4:]
    _setup(
        ctx,
        (input, linear_weight, target, linear_bias, weight),
        reduction,
        options[:4],
        output[1:],
        (grad_input, grad_weight, grad_bias and linear_bias is not None),
    )


def _lce_backward(ctx, grad_loss, *_):
    need_input, need_weight, _target, need_bias = ctx.needs_input_grad[:4]
    grads = None if grad_loss is None else _forward_grads(ctx, grad_loss, (need_input, need_weight, need_bias))
    if grads is None and grad_loss is not None:
        grads = torch.ops.fused.linear_cross_entropy_bwd(
            grad_loss, *ctx.saved_tensors, *ctx.options, need_input, need_weight, need_bias
        )
    gi, gw, gb = grads or (None, None, None)
    return (gi if need_input else None, gw if need_weight else None, None, gb if need_bias else None, *([None] * 9))


torch.library.register_autograd("fused::linear_cross_entropy_fwd", _lce_backward, setup_context=_lce_setup)


def _ce_setup(ctx, inputs, output):
    logits, target, weight, reduction, *options = inputs
    _setup(ctx, (logits, target, weight), reduction, options[:4], output[1:], (options[4],))


def _ce_backward(ctx, grad_loss, _grad_logits_output):
    grad = None
    if grad_loss is not None and ctx.needs_input_grad[0]:
        grad = _forward_grads(ctx, grad_loss, (True,))
        grad = grad[0] if grad else torch.ops.fused.cross_entropy_bwd(grad_loss, *ctx.saved_tensors, *ctx.options)
    return (grad, *([None] * 8))


torch.library.register_autograd("fused::cross_entropy_fwd", _ce_backward, setup_context=_ce_setup)


# ---- the public composites ----
def _needs_grad(*tensors):
    return [torch.is_grad_enabled() and t is not None and t.requires_grad for t in tensors]


def _loss_dtype(loss, like):
    """The input's dtype, or float32 under autocast (torch runs cross-entropy in float32 there)."""
    return loss if torch.is_autocast_enabled(like.device.type) else loss.to(like.dtype)


def _linear_cross_entropy(
    input,
    linear_weight,
    target,
    *,
    linear_bias=None,
    weight=None,
    reduction="mean",
    ignore_index=-100,
    label_smoothing=0.0,
    z_loss=0.0,
    softcap=None,
):
    op = "linear_cross_entropy"
    ignore_index = -100 if ignore_index is None else ignore_index
    check_options(op, reduction, label_smoothing, z_loss, softcap)
    if torch.is_autocast_enabled(input.device.type):  # the linear layer in autocast's dtype, as F.linear would be
        dtype = torch.get_autocast_dtype(input.device.type)
        input, linear_weight, linear_bias = (
            t.to(dtype) if t is not None and t.is_floating_point() and t.dtype != torch.float64 else t
            for t in (input, linear_weight, linear_bias)
        )
    check_linear_cross_entropy(op, input, linear_weight, target, linear_bias, weight)
    target = target.reshape(-1).long()
    check_target_range(op, target, linear_weight.shape[0], ignore_index)
    grads = _needs_grad(input, linear_weight, linear_bias) if reduction != "none" else [False] * 3
    loss = torch.ops.fused.linear_cross_entropy_fwd(
        input.reshape(-1, input.shape[-1]),
        linear_weight,
        target,
        linear_bias,
        weight,
        reduction,
        ignore_index,
        float(label_smoothing),
        float(z_loss),
        float(softcap or 0.0),
        *grads,
    )[0]
    loss = _loss_dtype(loss, input)
    return loss.view(input.shape[:-1]) if reduction == "none" else loss


def _cross_entropy(
    logits, target, *, weight=None, reduction="mean", ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=None
):
    op = "cross_entropy"
    check_options(op, reduction, label_smoothing, z_loss, softcap)
    check_logits(op, logits, target, weight)
    classes = logits.shape[min(1, logits.dim() - 1)]
    rows = logits.movedim(1, -1) if logits.dim() > 2 else logits  # (N, C, d1, ...): classes last (a copy)
    rows = rows.reshape(target.numel(), classes)  # (-1 cannot size it when classes is 0)
    if rows.stride(-1) != 1 and classes > 1:
        rows = rows.contiguous()
    flat_target = target.reshape(-1).long()
    check_target_range(op, flat_target, classes, ignore_index)
    grad = _needs_grad(logits)[0] and reduction != "none"
    loss = torch.ops.fused.cross_entropy_fwd(
        rows,
        flat_target,
        weight,
        reduction,
        ignore_index,
        float(label_smoothing),
        float(z_loss),
        float(softcap or 0.0),
        grad,
    )[0]
    loss = _loss_dtype(loss, logits)
    return loss.view(target.shape) if reduction == "none" else loss


_lib = torch.library.Library("fused", "IMPL")
_lib.impl("linear_cross_entropy", _linear_cross_entropy, "CompositeImplicitAutograd")
_lib.impl("cross_entropy", _cross_entropy, "CompositeImplicitAutograd")


# ---- CUDA tensors: the row kernel in CUDA C++ (fused::cuda_cross_entropy_rows, when compiled) or Triton ----
register_gpu("cross_entropy_rows", cuda_op="cuda_cross_entropy_rows", triton=f"{TRITON}:cross_entropy_rows")
