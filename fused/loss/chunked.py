"""The chunked "linear + row kernel" machinery every loss of the family runs on (cross-entropy, log-probs,
distillation): the rows of input [N, D] go in chunks sized from a memory budget, never holding the N x V logits.
Per chunk: the logits GEMM into one reused buffer, a row kernel (the loss's own math, a custom op) that returns
per-row values and writes the gradient of the loss with respect to the logits over them, then the backward GEMMs
(grad_input for the chunk's rows; grad_weight and grad_bias accumulated in the math dtype).

Also here: the linear layer's argument checks, the autocast cast, the public composites' keyword arguments, and the
autograd helpers of a loss whose forward computes its gradients ("mean" / "sum": the backward only scales them by
grad_output, in place)."""

import functools

import torch

from fused import _checks
from fused._autograd import traced
from fused._memory import advised

# The logits of one chunk of rows take at most this, or a quarter of linear_weight's size when that is larger:
# a few hundred rows or more per chunk, so that the GEMMs stay efficient, for a fraction of the memory the weight
# (and in training its gradient) takes anyway. A 16-bit weight gradient is added into its fp32 accumulator once per
# chunk (12 bytes of memory traffic per weight element), so there a chunk may take the weight's whole size: a
# quarter of the chunks, for one more weight-sized buffer next to the 3 the gradient already takes.
CHUNK_BYTES = 64 * 2**20
# 16-bit rows summed in float32 on the CPU go a few at a time, each a float32 temporary of at most this many elements.
SUM_ELEMENTS = 2**20
LINEAR_NAMES = ("input", "linear_weight", "linear_bias")


def math_dtype(t):
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def check_linear(op, input, linear_weight, linear_bias, names=LINEAR_NAMES):
    """input [..., D], linear_weight [V, D], linear_bias [V] or None; names: how the op calls the three."""
    x_name, w_name, b_name = names
    _checks.check_floating(op, x_name, input)
    _checks.check_like(op, w_name, linear_weight, x_name, input)
    if input.dim() < 1:
        raise RuntimeError(f"fused.{op}: {x_name} must have at least 1 dimension [..., in_features], got a scalar")
    if linear_weight.dim() != 2:
        raise RuntimeError(
            f"fused.{op}: {w_name} must be 2-D [classes, in_features], got shape "
            f"{tuple(linear_weight.shape)} (K-dimensional weights are not supported)"
        )
    if linear_weight.shape[1] != input.shape[-1]:
        raise RuntimeError(
            f"fused.{op}: {w_name} has in_features {linear_weight.shape[1]} but {x_name} has "
            f"{input.shape[-1]} (its last dimension)"
        )
    if linear_bias is not None:
        _checks.check_like(op, b_name, linear_bias, x_name, input)
        if linear_bias.dim() != 1 or linear_bias.shape[0] != linear_weight.shape[0]:
            raise RuntimeError(
                f"fused.{op}: {b_name} must be 1-D with {linear_weight.shape[0]} entries (one "
                f"per class), got shape {tuple(linear_bias.shape)}"
            )


def gemm_dtype(t):
    """The dtype the chunk's GEMMs run in: t's own, or float32 for 16-bit t on a CPU without 16-bit matrix
    instructions (AVX512-BF16 / AMX). There a bf16 or fp16 GEMM is emulated, several times slower than the float32
    GEMM of the upcast operands, which computes the same products (exact in float32) with the same float32
    accumulation, and keeps the logits in float32 instead of rounding them to 16 bits."""
    if t.dtype not in (torch.bfloat16, torch.float16) or t.device.type != "cpu":
        return t.dtype
    return t.dtype if _cpu_has_16bit_gemm(t.dtype) else torch.float32


@functools.cache
def _cpu_has_16bit_gemm(dtype):
    native = "_is_avx512_bf16_supported" if dtype == torch.bfloat16 else "_is_amx_fp16_supported"
    cpu = torch.cpu
    return getattr(cpu, native, lambda: False)() or (
        dtype == torch.bfloat16 and getattr(cpu, "_is_amx_tile_supported", lambda: False)()
    )


def chunk_rows(n_rows, linear_weight, accumulates_16bit=False, logits_dtype=None):
    """Rows per chunk: logits of logits_dtype (default: the weight's) within the budget CHUNK_BYTES explains."""
    weight_bytes = linear_weight.numel() * linear_weight.element_size()
    budget = max(CHUNK_BYTES, weight_bytes if accumulates_16bit else weight_bytes // 4)
    element = (linear_weight if logits_dtype is None else torch.empty((), dtype=logits_dtype)).element_size()
    return max(1, min(n_rows, budget // max(1, linear_weight.shape[0] * element)))


def _weight_slices(weight, scratch):
    """(c0, c1, weight[c0:c1] in scratch's dtype) over the classes, as many at a time as the flat buffer scratch
    holds: a 16-bit weight upcast a slice at a time into the one buffer, never whole, and never into fresh memory (on
    the CPU a fresh tensor of this size faults its pages in, which costs more than the copy: 27 against 3 ms for 16M
    elements, measured)."""
    D = weight.shape[1]
    classes = max(1, scratch.numel() // D)
    for c0 in range(0, weight.shape[0], classes):
        c1 = min(weight.shape[0], c0 + classes)
        yield c0, c1, scratch[: (c1 - c0) * D].view(c1 - c0, D).copy_(weight[c0:c1])


def _logits(x, weight, bias, out, scratch):
    """out = x @ weight.T + bias in out's dtype (x and weight upcast, the weight by slices through scratch, when that
    differs)."""
    if out.dtype == weight.dtype:
        if bias is None:
            return torch.mm(x, weight.t(), out=out)
        return torch.addmm(bias, x, weight.t(), out=out)
    x = x.to(out.dtype)
    for c0, c1, w in _weight_slices(weight, scratch):
        if bias is None:
            torch.mm(x, w.t(), out=out[:, c0:c1])
        else:
            torch.addmm(bias[c0:c1].to(out.dtype), x, w.t(), out=out[:, c0:c1])
    return out


def _accumulate(total, part):
    """total += part, total in float32 and part 16-bit. torch's mixed-dtype add first casts part into a fresh float32
    tensor, which on the CPU faults its pages in (30 against 4 ms for 16M elements, measured): there fused's own
    accumulation kernel (the optimizers' accumulate_grads_) adds it in registers."""
    if part.device.type == "cpu":
        torch.ops.fused.accumulate_grads_([total], [part], False)
    else:
        total += part


def _add_column_sums(total, rows):
    """total += rows.sum(0) in total's dtype. A 16-bit sum(0, dtype=float32) casts all of rows to a fresh float32 copy
    first (68 against 7 ms for 1024 x 32768 bf16 on the CPU, measured), so there rows are summed a few at a time."""
    if rows.dtype == total.dtype or rows.device.type != "cpu":
        total += rows.sum(0, dtype=total.dtype)
        return
    step = max(1, SUM_ELEMENTS // max(1, rows.shape[1]))
    for r in range(0, rows.shape[0], step):
        total += rows[r : r + step].sum(0, dtype=total.dtype)


def linear_chunks(input, linear_weight, linear_bias, row_kernel, n_outputs, grads, teacher=None):
    """(*outputs, grad_input, grad_weight, grad_bias) over the rows of input [N, D], chunk by chunk.

    row_kernel(logits, r0, r1, teacher_logits) runs on the chunk's logits [r1 - r0, V] (and the teacher's, when
    `teacher` = (input, weight, bias) of a second linear layer over the same rows: no gradient) and returns
    n_outputs per-row tensors in the math dtype; when a gradient is asked for it writes the gradient of the loss
    with respect to the logits over them. grads: which of (grad_input, grad_weight, grad_bias) to compute, the
    others come back empty. The logits are in gemm_dtype(input)."""
    *outputs, gi, gw, gb = _chunk_loop(input, linear_weight, linear_bias, row_kernel, n_outputs, grads, teacher)
    # The chunk buffers died with _chunk_loop's frame: the 16-bit weight gradient takes their memory, not more
    # (with them, 1065 MB of peak on an H200 at 4096 x 1024 x 131072 bf16, 256 of them the logits chunk's).
    return (*outputs, gi, gw.to(linear_weight.dtype), gb.to(linear_weight.dtype))


def _chunk_loop(input, linear_weight, linear_bias, row_kernel, n_outputs, grads, teacher):
    """linear_chunks' loop: the gradients in the math dtype."""
    grad_input, grad_weight, grad_bias = grads
    grad_bias = grad_bias and linear_bias is not None
    N, D = input.shape
    V = linear_weight.shape[0]
    acc, gemm = math_dtype(input), gemm_dtype(input)
    rows = chunk_rows(N, linear_weight, grad_weight and gemm != acc, gemm)
    logits = advised(input.new_empty(min(rows, N), V, dtype=gemm))
    teacher_logits = (
        None if teacher is None else advised(teacher[0].new_empty(min(rows, N), V, dtype=gemm_dtype(teacher[0])))
    )
    outputs = [input.new_empty(N, dtype=acc) for _ in range(n_outputs)]
    gi = advised(input.new_empty(N, D)) if grad_input else input.new_empty(0)
    gw = advised(input.new_empty(V, D, dtype=acc)).zero_() if grad_weight else input.new_empty(0)
    gb = input.new_zeros(V, dtype=acc) if grad_bias else input.new_empty(0)
    # Upcast GEMMs take each weight by slices of classes through one float32 scratch buffer. 16-bit GEMMs give a
    # chunk's weight gradient in 16 bits (fp32 inside), a slice of classes at a time into `part`, added into gw in
    # fp32. Both buffers are made once: fresh ones per slice would fault their pages in on the CPU.
    upcast = gemm != linear_weight.dtype or (teacher is not None and gemm_dtype(teacher[0]) != teacher[1].dtype)
    widest = max(D, 0 if teacher is None else teacher[1].shape[1])
    scratch_elements = min(max(CHUNK_BYTES // 4, widest), V * widest)  # a slice's budget, or the whole weight
    scratch = advised(input.new_empty(scratch_elements, dtype=torch.float32)) if upcast else None
    slice_classes = max(1, CHUNK_BYTES // max(1, D * 4))
    part = advised(input.new_empty(min(V, slice_classes), D, dtype=gemm)) if grad_weight and gemm != acc else None
    for r0 in range(0, N, rows):
        r1 = min(N, r0 + rows)
        x, buf = input[r0:r1].to(gemm), logits[: r1 - r0]  # upcast once a chunk where the GEMMs run in float32
        _logits(x, linear_weight, linear_bias, buf, scratch)
        teacher_buf = None
        if teacher is not None:
            teacher_buf = _logits(teacher[0][r0:r1], teacher[1], teacher[2], teacher_logits[: r1 - r0], scratch)
        for out, value in zip(outputs, row_kernel(buf, r0, r1, teacher_buf)):
            out[r0:r1] = value
        if grad_input and gemm != input.dtype:  # upcast GEMMs: the weight upcast by slices of classes
            gx = x.new_zeros(r1 - r0, D)
            for c0, c1, w in _weight_slices(linear_weight, scratch):
                gx.addmm_(buf[:, c0:c1], w)
            gi[r0:r1] = gx
        elif grad_input:
            torch.mm(buf, linear_weight, out=gi[r0:r1])
        if grad_weight and buf.dtype == acc:  # float32 logits (float32, or upcast 16-bit inputs) and float64
            gw.addmm_(buf.t(), x)
        elif grad_weight:
            for c0 in range(0, V, slice_classes):
                c1 = min(V, c0 + slice_classes)
                _accumulate(gw[c0:c1], torch.mm(buf[:, c0:c1].t(), x, out=part[: c1 - c0]))
        if grad_bias:
            _add_column_sums(gb, buf)
    return (*outputs, gi, gw, gb)


def plain(fn):
    """fn without autograd (it computes gradients itself; the backward ops have no autograd of their own) and
    without autocast (the composites cast their inputs; the GEMMs must run in the dtypes they are given)."""

    def run(*args):
        with torch.no_grad(), torch.autocast(args[0].device.type, enabled=False):
            return fn(*args)

    return run


def register_kernels(**fns):
    """The internal ops' kernels on every device: ATen's GEMMs and the row kernel, routed per device."""
    for name, fn in fns.items():
        torch.library.impl(f"fused::{name}", "CompositeExplicitAutograd", plain(fn))


@functools.cache
def _keyword_defaults(op):
    return tuple(
        (a.name, a.default_value) for a in getattr(torch.ops.fused, op).default._schema.arguments if a.kwarg_only
    )


def keyword_options(op, options):
    """fused::<op>'s keyword-only arguments in the schema's order, as a composite receives them in `options`: the
    dispatcher leaves out those equal to their defaults, which come from the schema (the one place that names and
    defaults them)."""
    return tuple(options.get(name, default) for name, default in _keyword_defaults(op))


def needs_grad(*tensors):
    return [torch.is_grad_enabled() and t is not None and t.requires_grad for t in tensors]


# ---- autograd of an op whose forward computes its gradients for "mean" / "sum" ----
def setup_forward_grads(ctx, saved, reduction, options, grads, computed):
    ctx.save_for_backward(*saved)
    ctx.options = (reduction, *options)
    ctx.mark_non_differentiable(*grads)
    ctx.set_materialize_grads(False)
    ctx.grads, ctx.computed = (grads, computed) if reduction != "none" else (None, None)


def forward_grads(ctx, grad_loss, needed):
    """Forward's gradients times grad_output, or None when forward has none for this backward. They are consumed:
    scaled in place and handed to autograd, which takes them as .grad without a copy; a later backward through
    the same graph (retain_graph, gradcheck) recomputes them with the backward op."""
    grads, ctx.grads = ctx.grads, None
    if grads is None or any(need and not done for need, done in zip(needed, ctx.computed)):
        return None
    # In place on plain tensors (eager); out of place when traced (torch.compile's fake and functional tensors).
    in_place = not traced([grad_loss, *grads])
    return [g.mul_(grad_loss) if in_place else g * grad_loss for g in grads]
