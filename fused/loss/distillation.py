"""fused.linear_distillation_loss: a divergence between a teacher's and a student's next-token distributions,
without either model's N x V logits: the chunked machinery (fused/loss/chunked.py) runs both linear heads over
the same chunk of rows, and the row kernel fused::distillation_rows writes the student's gradient over its logits.
The teacher is a constant (no gradient). As for cross-entropy, "mean" and "sum" compute the student's gradients in
forward when autograd will want them; "none" recomputes them in the backward with the per-token gradients."""

import torch

from fused import _checks
from fused._autocast import autocast_linear
from fused._autograd import register_autograd
from fused._backend import register_gpu
from fused.loss import chunked
from fused.loss.chunked import check_linear, math_dtype
from fused.loss.log_probs import check_row_logits, check_row_target, check_temperature
from fused.loss.ops import check_reduction, check_target

OP = "linear_distillation_loss"
DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")
STUDENT = ("student_input", "student_weight", "student_bias")
TEACHER = ("teacher_input", "teacher_weight", "teacher_bias")


def check_options(op, divergence, beta, temperature, reduction):
    if divergence not in DIVERGENCES:
        raise ValueError(f"fused.{op}: divergence must be 'forward_kl', 'reverse_kl' or 'jsd', got {divergence!r}")
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"fused.{op}: beta must be in [0, 1], got {beta}")
    check_temperature(op, temperature)
    check_reduction(op, reduction)


def check_distillation(op, student_input, student_weight, teacher_input, teacher_weight, target, sb, tb):
    check_linear(op, student_input, student_weight, sb, STUDENT)
    check_linear(op, teacher_input, teacher_weight, tb, TEACHER)
    if teacher_input.device != student_input.device:
        raise RuntimeError(
            f"fused.{op}: teacher_input is on {teacher_input.device} but student_input is on {student_input.device}"
        )
    if teacher_input.shape[:-1] != student_input.shape[:-1]:
        raise RuntimeError(
            f"fused.{op}: teacher_input must have the tokens of student_input {tuple(student_input.shape[:-1])}, "
            f"got shape {tuple(teacher_input.shape)}"
        )
    if teacher_weight.shape[0] != student_weight.shape[0]:
        raise RuntimeError(
            f"fused.{op}: teacher_weight must have the vocabulary of student_weight ({student_weight.shape[0]} "
            f"classes), got shape {tuple(teacher_weight.shape)}"
        )
    if target is not None:
        check_target(op, target, student_input.shape[:-1], student_input, (*student_input.shape[:-1], 0))


def check_distillation_rows(op, logits, teacher_logits, target, scale, grad, divergence, beta, temperature):
    """fused::distillation_rows' arguments, as csrc/loss/loss_args.h checks them."""
    check_row_logits(op, logits, grad)
    _checks.check_like(op, "teacher_logits", teacher_logits, "logits", logits)
    if teacher_logits.shape != logits.shape:
        raise RuntimeError(
            f"fused.{op}: teacher_logits must have the shape of logits {tuple(logits.shape)}, got "
            f"{tuple(teacher_logits.shape)}"
        )
    if target is not None:
        check_row_target(op, logits, target)
    acc, rows = math_dtype(logits), logits.shape[0]
    if scale.dtype != acc or scale.device != logits.device or tuple(scale.shape) not in ((), (rows,)):
        raise RuntimeError(
            f"fused.{op}: scale must be {acc} of shape [] or [{rows}] on {logits.device}, got shape "
            f"{tuple(scale.shape)}"
        )
    try:
        check_options(op, divergence, beta, temperature, "mean")
    except ValueError as e:
        raise RuntimeError(str(e)) from None


# ---- kernels of the internal ops ----
def _counted(target, ignore_index, n, dtype, device):
    """The divisor of "mean": the number of tokens the loss counts, at least 1 (a device tensor: no sync). With no
    token counted the loss is then 0 with zero gradients, as TRL's generalized_jsd_loss and Liger's JSD losses give
    it (their counts clamped at 1), not 0 / 0."""
    if target is None:
        return torch.tensor(float(max(n, 1)), dtype=dtype, device=device)
    return (target != ignore_index).sum().clamp_min(1).to(dtype)


def _chunks(si, sw, ti, tw, target, sb, tb, options, scale, grads):
    """(loss rows, grad_input, grad_weight, grad_bias); options: (divergence, beta, temperature, ignore_index)."""
    need_grad = any(grads)

    def rows(logits, r0, r1, teacher):
        # The row kernel takes both heads' logits in one dtype. Heads of different dtypes meet in the wider of the
        # two (at most the math dtype), so neither head's logits are rounded: eager takes each as it comes, and a
        # float32 teacher rounded to a bf16 student's logits would put bf16's error into p_T. A 16-bit student's
        # chunk is then upcast (one float32 chunk more) and its gradient rounded back once, as the kernel's own
        # 16-bit write rounds it.
        work = logits
        if teacher.dtype != logits.dtype:
            wide = torch.promote_types(logits.dtype, teacher.dtype)
            work = logits.to(math_dtype(logits) if wide == torch.float64 else wide)
            teacher = teacher.to(work.dtype)
        loss = torch.ops.fused.distillation_rows(
            work,
            teacher,
            None if target is None else target[r0:r1],
            scale if scale.dim() == 0 else scale[r0:r1],
            work if need_grad else work.new_empty(0),
            *options,
        )
        if need_grad and work is not logits:
            logits.copy_(work)
        return (loss,)

    return chunked.linear_chunks(si, sw, sb, rows, 1, grads, teacher=(ti, tw, tb))


def _fwd(si, sw, ti, tw, target, sb, tb, reduction, *options):
    """options: (divergence, beta, temperature, ignore_index, grad_input, grad_weight, grad_bias), the schema's."""
    row_options, grads = options[:4], options[4:] if reduction != "none" else (False,) * 3
    acc = math_dtype(si)
    count = _counted(target, row_options[3], si.shape[0], acc, si.device)
    scale = 1 / count if reduction == "mean" else torch.ones((), dtype=acc, device=si.device)
    loss_rows, gi, gw, gb = _chunks(si, sw, ti, tw, target, sb, tb, row_options, scale, grads)
    if reduction == "none":
        return loss_rows, gi, gw, gb
    return (loss_rows.sum() / count if reduction == "mean" else loss_rows.sum()), gi, gw, gb


def _bwd(grad_loss, si, sw, ti, tw, target, sb, tb, reduction, *options):
    row_options, grads = options[:4], options[4:]
    acc = math_dtype(si)
    scale = grad_loss.to(acc)
    if reduction == "mean":
        scale = scale / _counted(target, row_options[3], si.shape[0], acc, si.device)
    return _chunks(si, sw, ti, tw, target, sb, tb, row_options, scale, grads)[1:]


chunked.register_kernels(linear_distillation_fwd=_fwd, linear_distillation_bwd=_bwd)


# ---- fake kernels ----
@torch.library.register_fake("fused::distillation_rows")
def _(logits, teacher_logits, target, scale, grad, divergence, beta, temperature, ignore_index):
    check_distillation_rows(
        "distillation_rows", logits, teacher_logits, target, scale, grad, divergence, beta, temperature
    )
    return logits.new_empty(logits.shape[0], dtype=math_dtype(logits))


def _grad_shapes(si, sw, sb, grads):
    grad_input, grad_weight, grad_bias = grads
    return (
        si.new_empty(si.shape if grad_input else (0,)),
        sw.new_empty(sw.shape if grad_weight else (0,)),
        sw.new_empty(sw.shape[:1] if grad_bias and sb is not None else (0,)),
    )


@torch.library.register_fake("fused::linear_distillation_fwd")
def _(si, sw, ti, tw, target, sb, tb, reduction, *options):
    check_distillation(OP, si, sw, ti, tw, target, sb, tb)
    loss = si.new_empty((si.shape[0],) if reduction == "none" else (), dtype=math_dtype(si))
    return loss, *_grad_shapes(si, sw, sb, options[4:] if reduction != "none" else (False,) * 3)


@torch.library.register_fake("fused::linear_distillation_bwd")
def _(grad_loss, si, sw, ti, tw, target, sb, tb, reduction, *options):
    return _grad_shapes(si, sw, sb, options[4:])


# ---- autograd: the first backward of "mean" / "sum" scales forward's gradients; otherwise the backward op ----
def _setup(ctx, inputs, output):
    si, sw, ti, tw, target, sb, tb, reduction, *options = inputs
    grad_input, grad_weight, grad_bias = options[4:]
    saved = (si, sw, ti, tw, target, sb, tb)
    computed = (grad_input, grad_weight, grad_bias and sb is not None)
    chunked.setup_forward_grads(ctx, saved, reduction, options[:4], output[1:], computed)


def _backward(ctx, grad_loss, *_):
    need = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[5])
    grads = None if grad_loss is None else chunked.forward_grads(ctx, grad_loss, need)
    if grads is None and grad_loss is not None:
        grads = torch.ops.fused.linear_distillation_bwd(grad_loss, *ctx.saved_tensors, *ctx.options, *need)
    gi, gw, gb = [g if n else None for g, n in zip(grads, need)] if grads else (None, None, None)
    return gi, gw, None, None, None, gb, *([None] * 9)


linear_distillation_fwd = register_autograd("linear_distillation_fwd", _backward, _setup)


# ---- the public composite ----
def _linear_distillation_loss(student_input, student_weight, teacher_input, teacher_weight, target=None, **options):
    student_bias, teacher_bias, divergence, beta, temperature, ignore_index, reduction = chunked.keyword_options(
        OP, options
    )
    check_options(OP, divergence, beta, temperature, reduction)
    student_input, student_weight, student_bias = autocast_linear(student_input, student_weight, student_bias)
    teacher_input, teacher_weight, teacher_bias = autocast_linear(teacher_input, teacher_weight, teacher_bias)
    check_distillation(
        OP, student_input, student_weight, teacher_input, teacher_weight, target, student_bias, teacher_bias
    )
    shape = student_input.shape[:-1]
    grads = chunked.needs_grad(student_input, student_weight, student_bias) if reduction != "none" else [False] * 3
    loss = linear_distillation_fwd(
        student_input.reshape(-1, student_input.shape[-1]),
        student_weight,
        teacher_input.detach().reshape(-1, teacher_input.shape[-1]),
        teacher_weight.detach(),
        None if target is None else target.reshape(-1).long(),
        student_bias,
        None if teacher_bias is None else teacher_bias.detach(),
        reduction,
        divergence,
        float(beta),
        float(temperature),
        ignore_index,
        *grads,
    )[0]
    return loss.view(shape) if reduction == "none" else loss


_lib = torch.library.Library("fused", "IMPL")
_lib.impl(OP, _linear_distillation_loss, "CompositeImplicitAutograd")
register_gpu(
    "distillation_rows", cuda_op="cuda_distillation_rows", triton="fused.loss.triton_logprob:distillation_rows"
)
