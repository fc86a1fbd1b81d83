"""Registration of the distance ops: fake kernels (torch.compile), autograd (backward made of fused ops), the
composite chamfer_distance, and the CUDA-device routing between the CUDA C++ and Triton kernels."""

import math

import torch

from fused import _checks
from fused._autocast import autocast_float32, register_autocast_float32
from fused._autograd import register_autograd
from fused._backend import register_gpu
from fused._codes import MAX_SELECT

TRITON = "fused.distance.triton_kernels"
# The path rule, as in csrc/distance/distance_cpu.h: p = 2 with D >= MATMUL_MIN_D takes the matmul (tensor-core)
# path; everything else the direct differences.
MATMUL_MIN_D = 32


# ---- checks shared by the fake kernels ----
def check_p(op, p, squared):
    if not p >= 0:  # also rejects NaN
        raise RuntimeError(f"fused.{op}: p must be in [0, inf], got {p}")
    if squared and p != 2:
        raise RuntimeError(f"fused.{op}: squared=True needs p=2, got p={p}")


def batch_shape(op, a, b):
    """The broadcast batch shape of a [*Ba, N, D] and b [*Bb, M, D]."""
    _checks.check_floating(op, "a", a)
    _checks.check_like(op, "b", b, "a", a)
    if a.dim() < 2:
        raise RuntimeError(f"fused.{op}: a must have at least 2 dims [*B, N, D], got shape {tuple(a.shape)}")
    if b.dim() < 2:
        raise RuntimeError(f"fused.{op}: b must have at least 2 dims [*B, M, D], got shape {tuple(b.shape)}")
    if a.shape[-1] != b.shape[-1]:
        raise RuntimeError(f"fused.{op}: a and b must have the same last dim D, got {a.shape[-1]} and {b.shape[-1]}")
    try:
        return torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    except RuntimeError:
        raise RuntimeError(
            f"fused.{op}: the batch dims of a {tuple(a.shape)} and b {tuple(b.shape)} do not broadcast"
        ) from None


def check_k(op, k, m):
    if k < 0:
        raise RuntimeError(f"fused.{op}: k must be >= 0, got {k}")
    if k > m:
        raise RuntimeError(f"fused.{op}: k ({k}) is larger than the number of points in b ({m})")


def check_radius(op, radius, max_neighbors):
    if not radius >= 0:  # also rejects NaN
        raise RuntimeError(f"fused.{op}: radius must be in [0, inf], got {radius}")
    if max_neighbors < 1:
        raise RuntimeError(f"fused.{op}: max_neighbors must be >= 1, got {max_neighbors}")


def check_lengths(op, name, lengths, t_name, t):
    """A padded batch's valid row counts: int64, on t's device, of t's batch shape (values: check_length_values)."""
    if lengths is None:
        return
    _checks.check_tensor(op, name, lengths)
    if lengths.dtype != torch.int64:
        raise RuntimeError(f"fused.{op}: {name} must be an int64 tensor, got {lengths.dtype}")
    _checks.check_same_device(op, name, lengths, t_name, t)
    if lengths.shape != t.shape[:-2]:
        raise RuntimeError(
            f"fused.{op}: {name} must have the batch shape of {t_name} {list(t.shape[:-2])}, got {list(lengths.shape)}"
        )


def check_length_values(op, name, lengths, rows):
    """Every count in [0, rows] (reads them: a device sync on a GPU)."""
    if lengths is None or lengths.numel() == 0:
        return
    lo, hi = int(lengths.min()), int(lengths.max())
    if lo < 0:
        raise RuntimeError(f"fused.{op}: {name} must not be negative, got {lo}")
    if hi > rows:
        raise RuntimeError(f"fused.{op}: {name} has a length {hi} larger than the padded size {rows}")


def _readable(t):
    return t is not None and _checks.values_readable(t)


def check_both_lengths(op, a, b, lengths_a, lengths_b):
    check_lengths(op, "lengths_a", lengths_a, "a", a)
    check_lengths(op, "lengths_b", lengths_b, "b", b)


# ---- fake kernels ----
@torch.library.register_fake("fused::pairwise_distances")
def _(a, b, p=2.0, squared=False, lengths_a=None, lengths_b=None):
    check_p("pairwise_distances", p, squared)
    batch = batch_shape("pairwise_distances", a, b)
    check_both_lengths("pairwise_distances", a, b, lengths_a, lengths_b)
    return a.new_empty((*batch, a.shape[-2], b.shape[-2]))


@torch.library.register_fake("fused::pairwise_distances_backward")
def _(grad, a, b, dist, p, squared, lengths_a=None, lengths_b=None):
    return torch.empty_like(a, memory_format=torch.contiguous_format), torch.empty_like(
        b, memory_format=torch.contiguous_format
    )


@torch.library.register_fake("fused::pairwise_topk")
def _(a, b, k, p=2.0, squared=False, largest=False, lengths_a=None, lengths_b=None):
    check_p("pairwise_topk", p, squared)
    batch = batch_shape("pairwise_topk", a, b)
    check_k("pairwise_topk", k, b.shape[-2])
    check_both_lengths("pairwise_topk", a, b, lengths_a, lengths_b)
    shape = (*batch, a.shape[-2], k)
    return a.new_empty(shape), a.new_empty(shape, dtype=torch.int64)


@torch.library.register_fake("fused::radius_neighbors")
def _(a, b, radius, max_neighbors, lengths_a=None, lengths_b=None, p=2.0):
    check_p("radius_neighbors", p, False)
    check_radius("radius_neighbors", radius, max_neighbors)
    batch = batch_shape("radius_neighbors", a, b)
    check_both_lengths("radius_neighbors", a, b, lengths_a, lengths_b)
    shape = (*batch, a.shape[-2], max_neighbors)
    return a.new_empty(shape), a.new_empty(shape, dtype=torch.int64)


@torch.library.register_fake("fused::pairwise_topk_backward")
def _(grad, a, b, values, indices, p, squared):
    return torch.empty_like(a, memory_format=torch.contiguous_format), torch.empty_like(
        b, memory_format=torch.contiguous_format
    )


# ---- autograd ----
def _distances_setup(ctx, inputs, output):
    a, b, p, squared, lengths_a, lengths_b = inputs
    ctx.save_for_backward(a, b, output, lengths_a, lengths_b)
    ctx.p, ctx.squared = p, squared


def _rounded_max_norm(a, p):
    """The max-norm's gradient goes to the coordinates whose |a - b| equals the distance. The backward kernels find
    them by comparing with the saved distances, which 16-bit storage has rounded (most of them would be missed), so
    such backwards run in float32 on distances recomputed there: exact, like the float64 reference."""
    return math.isinf(p) and a.dtype in (torch.float16, torch.bfloat16) and a.shape[-1] > 0


def _distances_backward(ctx, grad):
    a, b, dist, lengths_a, lengths_b = ctx.saved_tensors
    if _rounded_max_norm(a, ctx.p):
        a32, b32 = a.float(), b.float()
        dist32 = pairwise_distances(a32, b32, ctx.p, False, lengths_a, lengths_b)
        grad_a, grad_b = torch.ops.fused.pairwise_distances_backward(
            grad.float().contiguous(), a32, b32, dist32, ctx.p, False, lengths_a, lengths_b
        )
        return grad_a.to(a.dtype), grad_b.to(b.dtype), None, None, None, None
    grad_a, grad_b = torch.ops.fused.pairwise_distances_backward(
        grad.contiguous(), a, b, dist, ctx.p, ctx.squared, lengths_a, lengths_b
    )
    return grad_a, grad_b, None, None, None, None


pairwise_distances = register_autograd("pairwise_distances", _distances_backward, _distances_setup)


def _selected_setup(ctx, values, indices, a, b, p, squared):
    ctx.mark_non_differentiable(indices)
    ctx.save_for_backward(a, b, values, indices)
    ctx.p, ctx.squared = p, squared


def _selected_backward(ctx, grad_values):
    """Through the selected pairs (pairwise_topk, radius_neighbors): grad_a, grad_b."""
    a, b, values, indices = ctx.saved_tensors
    if _rounded_max_norm(a, ctx.p) and b.shape[-2] > 0:  # the selected pairs' distances recomputed in float32
        a32, b32 = a.float(), b.float()
        batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
        (n, d), m, k = a.shape[-2:], b.shape[-2], indices.shape[-1]
        flat = indices.clamp(min=0).reshape(*batch, n * k, 1).expand(*batch, n * k, d)  # -1: no pair, not read
        rows = torch.gather(b32.expand(*batch, m, d), -2, flat).reshape(*batch, n, k, d)
        values32 = (a32.expand(*batch, n, d).unsqueeze(-2) - rows).abs().amax(-1)
        grad_a, grad_b = torch.ops.fused.pairwise_topk_backward(
            grad_values.float().contiguous(), a32, b32, values32, indices, ctx.p, False
        )
        return grad_a.to(a.dtype), grad_b.to(b.dtype)
    return torch.ops.fused.pairwise_topk_backward(grad_values.contiguous(), a, b, values, indices, ctx.p, ctx.squared)


def _topk_setup(ctx, inputs, output):
    a, b, k, p, squared, largest, lengths_a, lengths_b = inputs
    _selected_setup(ctx, *output, a, b, p, squared)


def _topk_backward(ctx, grad_values, grad_indices):
    return *_selected_backward(ctx, grad_values), None, None, None, None, None, None


def _radius_setup(ctx, inputs, output):
    a, b, radius, max_neighbors, lengths_a, lengths_b, p = inputs
    _selected_setup(ctx, *output, a, b, p, False)


def _radius_backward(ctx, grad_values, grad_indices):
    return *_selected_backward(ctx, grad_values), None, None, None, None, None


pairwise_topk = register_autograd("pairwise_topk", _topk_backward, _topk_setup)
radius_neighbors = register_autograd("radius_neighbors", _radius_backward, _radius_setup)


# ---- chamfer_distance: pairwise_topk with k = 1 each way (autograd through it) and the per-cloud reduction ----
REDUCTIONS = ("mean", "sum")


def _nearest(a, b, lengths_a, lengths_b, p, squared):
    """The nearest valid row of b for each row of a: (distances [*B, N], indices [*B, N], -1 where there is
    none: padded rows of a, or no valid row in b)."""
    if b.shape[-2] == 0:  # k = 1 needs a row of b; no row: no neighbour
        batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
        idx = torch.full((*batch, a.shape[-2]), -1, dtype=torch.int64, device=a.device)
        return a.new_full(idx.shape, math.inf), idx
    v, i = pairwise_topk(a, b, 1, p, squared, False, lengths_a, lengths_b)
    return v.squeeze(-1), i.squeeze(-1)


def _per_cloud(dist, idx, lengths, reduction):
    """The sum (mean) over each cloud's valid points of their distance; points without a neighbour count 0, the
    mean of an empty cloud is 0 (PyTorch3D's convention). Accumulated in float32 (float64 for float64)."""
    acc = torch.float64 if dist.dtype == torch.float64 else torch.float32
    total = torch.where(idx >= 0, dist.to(acc), 0.0).sum(-1)
    if reduction == "sum":
        return total
    rows = lengths.to(acc).clamp(min=1) if lengths is not None else max(dist.shape[-1], 1)
    return total / rows


def _chamfer_distance(
    a, b, lengths_a=None, lengths_b=None, p=2.0, squared=True, reduction="mean", single_directional=False
):
    op = "chamfer_distance"
    check_p(op, p, squared)
    batch_shape(op, a, b)
    check_both_lengths(op, a, b, lengths_a, lengths_b)
    for name, lengths, t in (("lengths_a", lengths_a, a), ("lengths_b", lengths_b, b)):
        if _readable(lengths):  # else pairwise_topk checks them, by its own name
            check_length_values(op, name, lengths, t.shape[-2])
    if reduction not in REDUCTIONS:
        raise RuntimeError(f"fused.{op}: unknown reduction {reduction!r}; expected one of {', '.join(REDUCTIONS)}")
    a, b = autocast_float32("distance", a, b)
    dist_a, idx_a = _nearest(a, b, lengths_a, lengths_b, p, squared)
    loss = _per_cloud(dist_a, idx_a, lengths_a, reduction)
    if single_directional:
        idx_b = idx_a.new_empty((*idx_a.shape[:-1], 0))
    else:
        dist_b, idx_b = _nearest(b, a, lengths_b, lengths_a, p, squared)
        loss = loss + _per_cloud(dist_b, idx_b, lengths_b, reduction)
    return loss.mean().to(a.dtype), idx_a, idx_b


_lib = torch.library.Library("fused", "IMPL")
_lib.impl("chamfer_distance", _chamfer_distance, "CompositeImplicitAutograd")
register_autocast_float32("distance", "pairwise_distances", "pairwise_topk", "radius_neighbors")


# ---- CUDA tensors ----
# pairwise_distances, pairwise_topk, radius_neighbors: the CUDA C++ kernels are the direct path; p = 2 at D >= 32
# (not float64) is the tensor-core path, which is Triton's, whichever backend is set (the path depends on
# (p, D, dtype) only). Both backward ops have both implementations (pairwise_topk's serves radius_neighbors and
# chamfer_distance too).
def _tensor_core(a, p):
    return p == 2 and a.shape[-1] >= MATMUL_MIN_D and a.dtype != torch.float64


# Each op's arguments as the dispatcher passes them (positional, trailing defaults left out).
def _tensor_core_path(a, b, p=2.0, *rest):
    return _tensor_core(a, p)


# The selection ops also go to Triton when they keep more neighbours per row, or take longer rows, than the CUDA
# C++ kernel does (csrc/distance/distance_cuda.cpp's select_cuda refuses those): its tile of b in shared memory
# holds D coordinates of the math type in csrc/distance/distance_kernels.h's kSelectTileBytes.
SELECT_TILE_BYTES = 32768


def _topk_triton_path(a, b, k, p=2.0, *rest):
    math_bytes = 8 if a.dtype == torch.float64 else 4
    return _tensor_core(a, p) or min(k, b.shape[-2]) > MAX_SELECT or a.shape[-1] * math_bytes > SELECT_TILE_BYTES


def _radius_triton_path(a, b, radius, max_neighbors, lengths_a=None, lengths_b=None, p=2.0):
    return _topk_triton_path(a, b, max_neighbors, p)


TRITON_WHEN = {
    "pairwise_distances": _tensor_core_path,
    "pairwise_topk": _topk_triton_path,
    "radius_neighbors": _radius_triton_path,
}
for _op, _when in TRITON_WHEN.items():
    register_gpu(_op, cuda_op=f"cuda_{_op}", triton=f"{TRITON}:{_op}", triton_when=_when)
register_gpu(
    "pairwise_distances_backward",
    cuda_op="cuda_pairwise_distances_backward",
    triton=f"{TRITON}:pairwise_distances_backward",
)
register_gpu("pairwise_topk_backward", cuda_op="cuda_pairwise_topk_backward", triton=f"{TRITON}:pairwise_topk_backward")
