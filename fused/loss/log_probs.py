"""fused.linear_log_probs: per-token log-probs of the targets (and the entropy) of a linear head, without the
N x V logits: the chunked machinery (fused/loss/chunked.py) around the row kernel fused::log_prob_rows.

Forward runs the chunks without gradients; the backward takes the per-token upstream gradients of log-probs and
entropy (any use: weights per token, sums per sequence, ratios) and runs the chunks again, the row kernel writing
each chunk's gradient of sum_r (g_logp[r] logp[r] + g_entropy[r] entropy[r]) over its logits."""

import torch

from fused import _checks
from fused._autocast import autocast_linear
from fused._autograd import register_autograd
from fused._backend import register_gpu
from fused.loss import chunked
from fused.loss.chunked import check_linear, math_dtype
from fused.loss.ops import check_target, check_target_range

OP = "linear_log_probs"


def check_temperature(op, temperature):
    if not temperature > 0.0:
        raise ValueError(f"fused.{op}: temperature must be > 0, got {temperature}")


def check_row_target(op, logits, target):
    rows = logits.shape[0]
    if target.dtype != torch.int64 or target.shape != (rows,) or target.device != logits.device:
        raise RuntimeError(
            f"fused.{op}: target must be int64 of shape ({rows},) on {logits.device}, got "
            f"{target.dtype} of shape {tuple(target.shape)} on {target.device}"
        )


def check_row_logits(op, logits, grad):
    """The row kernels' logits [rows, V] and grad (empty, or logits' shape with unit column stride)."""
    _checks.check_floating(op, "logits", logits)
    if logits.dim() != 2:
        raise RuntimeError(f"fused.{op}: logits must be 2-D [rows, classes], got shape {tuple(logits.shape)}")
    if grad.numel():
        _checks.check_like(op, "grad", grad, "logits", logits)
        if grad.shape != logits.shape or (logits.shape[1] > 1 and grad.stride(1) != 1):
            raise RuntimeError(
                f"fused.{op}: grad must be empty (no gradient) or have the shape of logits with unit "
                f"column stride, got shape {tuple(grad.shape)} and strides {grad.stride()}"
            )


def check_log_prob_rows(op, logits, target, scale, grad, temperature):
    """fused::log_prob_rows' arguments, as csrc/loss/loss_args.h checks them."""
    check_row_logits(op, logits, grad)
    check_row_target(op, logits, target)
    acc, rows = math_dtype(logits), logits.shape[0]
    if scale.dtype != acc or scale.device != logits.device or tuple(scale.shape) != (rows, 2):
        raise RuntimeError(
            f"fused.{op}: scale must be {acc} of shape [{rows}, 2] on {logits.device}, got shape {tuple(scale.shape)}"
        )
    if not temperature > 0.0:
        raise RuntimeError(f"fused.{op}: temperature must be > 0, got {temperature}")


def check_linear_log_probs(op, input, linear_weight, target, linear_bias):
    check_linear(op, input, linear_weight, linear_bias)
    check_target(op, target, input.shape[:-1], input, (*input.shape[:-1], linear_weight.shape[0]))


# ---- kernels of the internal ops ----
def _chunks(input, linear_weight, target, linear_bias, temperature, ignore_index, scale, grads):
    """(logp rows, entropy rows, grad_input, grad_weight, grad_bias); scale [N, 2]: the per-row upstream gradients."""
    need_grad = any(grads)

    def rows(logits, r0, r1, _teacher):
        grad = logits if need_grad else logits.new_empty(0)
        return torch.ops.fused.log_prob_rows(logits, target[r0:r1], scale[r0:r1], grad, ignore_index, temperature)

    return chunked.linear_chunks(input, linear_weight, linear_bias, rows, 2, grads)


def _fwd(input, linear_weight, target, linear_bias, temperature, ignore_index):
    scale = input.new_zeros(input.shape[0], 2, dtype=math_dtype(input))  # (read only with a gradient)
    return _chunks(input, linear_weight, target, linear_bias, temperature, ignore_index, scale, (False,) * 3)[:2]


def _bwd(grad_logp, grad_entropy, input, linear_weight, target, linear_bias, temperature, ignore_index, *grads):
    scale = torch.stack([grad_logp, grad_entropy], dim=1).to(math_dtype(input))
    return _chunks(input, linear_weight, target, linear_bias, temperature, ignore_index, scale, grads)[2:]


chunked.register_kernels(linear_log_probs_fwd=_fwd, linear_log_probs_bwd=_bwd)


# ---- fake kernels ----
@torch.library.register_fake("fused::log_prob_rows")
def _(logits, target, scale, grad, ignore_index, temperature):
    check_log_prob_rows("log_prob_rows", logits, target, scale, grad, temperature)
    rows, acc = logits.shape[0], math_dtype(logits)
    return logits.new_empty(rows, dtype=acc), logits.new_empty(rows, dtype=acc)


@torch.library.register_fake("fused::linear_log_probs_fwd")
def _(input, linear_weight, target, linear_bias, temperature, ignore_index):
    check_linear_log_probs(OP, input, linear_weight, target, linear_bias)
    n, acc = input.shape[0], math_dtype(input)
    return input.new_empty(n, dtype=acc), input.new_empty(n, dtype=acc)


@torch.library.register_fake("fused::linear_log_probs_bwd")
def _(grad_logp, grad_entropy, input, linear_weight, target, linear_bias, temperature, ignore_index, *grads):
    grad_input, grad_weight, grad_bias = grads
    return (
        input.new_empty(input.shape if grad_input else (0,)),
        linear_weight.new_empty(linear_weight.shape if grad_weight else (0,)),
        linear_weight.new_empty(linear_weight.shape[:1] if grad_bias and linear_bias is not None else (0,)),
    )


# ---- autograd: the backward op with the per-token upstream gradients ----
def _setup(ctx, inputs, output):
    input, linear_weight, target, linear_bias, temperature, ignore_index = inputs
    ctx.save_for_backward(input, linear_weight, target, linear_bias)
    ctx.options = (temperature, ignore_index)


def _backward(ctx, grad_logp, grad_entropy):
    need_input, need_weight, _target, need_bias = ctx.needs_input_grad[:4]
    gi, gw, gb = torch.ops.fused.linear_log_probs_bwd(
        grad_logp, grad_entropy, *ctx.saved_tensors, *ctx.options, need_input, need_weight, need_bias
    )
    return gi if need_input else None, gw if need_weight else None, None, gb if need_bias else None, None, None


linear_log_probs_fwd = register_autograd("linear_log_probs_fwd", _backward, _setup)


# ---- the public composite ----
def _linear_log_probs(input, linear_weight, target, **options):
    linear_bias, temperature, ignore_index, return_entropy = chunked.keyword_options(OP, options)
    check_temperature(OP, temperature)
    input, linear_weight, linear_bias = autocast_linear(input, linear_weight, linear_bias)
    check_linear_log_probs(OP, input, linear_weight, target, linear_bias)
    flat_target = target.reshape(-1).long()
    check_target_range(OP, flat_target, linear_weight.shape[0], ignore_index)
    logp, entropy = linear_log_probs_fwd(
        input.reshape(-1, input.shape[-1]), linear_weight, flat_target, linear_bias, float(temperature), ignore_index
    )
    entropy = entropy.view(target.shape) if return_entropy else entropy.new_empty(0)
    return logp.view(target.shape), entropy


_lib = torch.library.Library("fused", "IMPL")
_lib.impl(OP, _linear_log_probs, "CompositeImplicitAutograd")
register_gpu("log_prob_rows", cuda_op="cuda_log_prob_rows", triton="fused.loss.triton_logprob:log_prob_rows")
