"""The global gradient norm over plain and DTensor (FSDP2) gradients, on the fused kernels: pass 1 of every
fused optimizer step and of fused.clip_grad_norm_. Single process: one grad_norm launch that also finishes
the norm and the clip coefficient on the device. Sharded gradients: a local sum, one all-reduce, then the finish."""

import functools
import math

import torch
import torch.distributed as dist

INF = math.inf


@functools.cache
def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return None
    return DTensor


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def local(t):
    """The local shard of a DTensor, the tensor itself otherwise."""
    if type(t) in _PLAIN:  # the common case, without the subclass check
        return t
    dtensor = _dtensor_type()
    return t.to_local() if dtensor is not None and isinstance(t, dtensor) else t


def is_sharded(t):
    dtensor = _dtensor_type()
    return dtensor is not None and isinstance(t, dtensor) and any(pl.is_shard() for pl in t.placements)


def check_one_device(op, tensors):
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise RuntimeError(
            f"fused.{op}: all parameters of one call must be on one device, got {', '.join(sorted(map(str, devices)))}"
        )


def is_dense(t):
    """Whether t covers its elements exactly in some dimension order (no gaps, no overlap): what the kernels walk
    as flat memory (torch's is_non_overlapping_and_dense)."""
    expected = 1
    for stride, size in sorted((st, n) for st, n in zip(t.stride(), t.shape) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def overlaps_itself(t):
    """Whether elements of t share memory (an expanded tensor: stride 0 over a dim of size > 1), as torch's in-place
    ops find it."""
    return any(stride == 0 and size > 1 for stride, size in zip(t.stride(), t.shape))


def check_grads(op, grads, written):
    """Sparse gradients are refused; strided ones are taken (through a dense copy). Where the call writes the
    gradients, one that overlaps itself is refused, as torch's in-place ops refuse it."""
    for g in grads:
        if g.is_sparse or g.layout != torch.strided:
            raise RuntimeError(f"fused.{op}: sparse gradients are not supported")
        if written and overlaps_itself(local(g)):
            raise RuntimeError(
                f"fused.{op}: a gradient of shape {tuple(g.shape)} overlaps itself in memory (an "
                f"expanded tensor, strides {local(g).stride()}): it cannot be written in place, as "
                "torch's in-place ops refuse it; clone() it"
            )


def _shard_groups(t):
    """The process groups over which a sharded DTensor's local sums must be added."""
    mesh = t.device_mesh
    return [mesh.get_group(d) for d, pl in enumerate(t.placements) if pl.is_shard()]


def norm_dtype(tensors):
    """The dtype of a norm over `tensors`, as torch's clip_grad_norm_ returns it: their promoted dtype."""
    return (
        functools.reduce(torch.promote_types, [t.dtype for t in tensors], tensors[0].dtype)
        if tensors
        else torch.float32
    )


def global_norm(grads, found_inf, grad_scale, norm_type, max_norm, clip_value, tensors=None):
    """(norm, clip_coef, found_inf): device scalars, the norm in the gradients' dtype (norm_dtype), clip_coef
    float64, found_inf float32. `grads` may mix plain tensors and DTensors; found_inf comes back set where the
    found_inf argument (None: unset) is, or a gradient is not finite (on any rank). tensors: what the kernel reads
    for each of grads (default: its local tensor), e.g. a dense copy."""
    max_norm = INF if max_norm is None else float(max_norm)
    clip_value = INF if clip_value is None else float(clip_value)
    norm_type = float(norm_type)
    tensors = [local(g) for g in grads] if tensors is None else tensors
    sharded = [t for g, t in zip(grads, tensors) if is_sharded(g)]
    if not sharded:
        return torch.ops.fused.grad_norm(tensors, found_inf, grad_scale, norm_type, max_norm, clip_value, True)
    replicated = [t for g, t in zip(grads, tensors) if not is_sharded(g)]
    acc, _, found_inf = torch.ops.fused.grad_norm(
        sharded, found_inf, grad_scale, norm_type, max_norm, clip_value, False
    )
    op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
    for group in _shard_groups(next(g for g in grads if is_sharded(g))):
        dist.all_reduce(acc, op=op, group=group)
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=group)
    if replicated:
        rest, _, found_inf = torch.ops.fused.grad_norm(
            replicated, found_inf, grad_scale, norm_type, max_norm, clip_value, False
        )
        acc = torch.maximum(acc, rest) if math.isinf(norm_type) else acc + rest
    norm = acc if norm_type in (1.0, INF) else acc.pow(1.0 / norm_type)  # float64, as the kernel's finish
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0) if not math.isinf(max_norm) else torch.ones_like(norm)
    return norm.to(norm_dtype(tensors)), coef, found_inf
