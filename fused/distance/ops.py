"""Registration of the distance ops: fake kernels (torch.compile), autograd (backward made of fused ops), and
the CUDA-device routing between the CUDA C++ and Triton kernels."""

import math

import torch

from fused import _checks
from fused._backend import register_gpu

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
        raise RuntimeError(f"fused.{op}: a and b must have the same last dim D, got {a.shape[-1]} and "
                           f"{b.shape[-1]}")
    try:
        return torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    except RuntimeError:
        raise RuntimeError(f"fused.{op}: the batch dims of a {tuple(a.shape)} and b {tuple(b.shape)} do not "
                           "broadcast") from None


def check_k(op, k, m):
    if k < 0:
        raise RuntimeError(f"fused.{op}: k must be >= 0, got {k}")
    if k > m:
        raise RuntimeError(f"fused.{op}: k ({k}) is larger than the number of points in b ({m})")


# ---- fake kernels ----
@torch.library.register_fake("fused::pairwise_distances")
def _(a, b, p=2.0, squared=False):
    check_p("pairwise_distances", p, squared)
    batch = batch_shape("pairwise_distances", a, b)
    return a.new_empty((*batch, a.shape[-2], b.shape[-2]))


@torch.library.register_fake("fused::pairwise_distances_backward")
def _(grad, a, b, dist, p, squared):
    return torch.empty_like(a, memory_format=torch.contiguous_format), \
        torch.empty_like(b, memory_format=torch.contiguous_format)


@torch.library.register_fake("fused::pairwise_topk")
def _(a, b, k, p=2.0, squared=False, largest=False):
    check_p("pairwise_topk", p, squared)
    batch = batch_shape("pairwise_topk", a, b)
    check_k("pairwise_topk", k, b.shape[-2])
    shape = (*batch, a.shape[-2], k)
    return a.new_empty(shape), a.new_empty(shape, dtype=torch.int64)


@torch.library.register_fake("fused::pairwise_topk_backward")
def _(grad, a, b, values, indices, p, squared):
    return torch.empty_like(a, memory_format=torch.contiguous_format), \
        torch.empty_like(b, memory_format=torch.contiguous_format)


# ---- autograd ----
def _distances_setup(ctx, inputs, output):
    a, b, p, squared = inputs
    ctx.save_for_backward(a, b, output)
    ctx.p, ctx.squared = p, squared


def _rounded_max_norm(a, p):
    """The max-norm's gradient goes to the coordinates whose |a - b| equals the distance. The backward kernels find
    them by comparing with the saved distances, which 16-bit storage has rounded (most of them would be missed), so
    such backwards run in float32 on distances recomputed there: exact, like the float64 reference."""
    return math.isinf(p) and a.dtype in (torch.float16, torch.bfloat16) and a.shape[-1] > 0


def _distances_backward(ctx, grad):
    a, b, dist = ctx.saved_tensors
    if _rounded_max_norm(a, ctx.p):
        a32, b32 = a.float(), b.float()
        dist32 = torch.ops.fused.pairwise_distances(a32, b32, ctx.p, False)
        grad_a, grad_b = torch.ops.fused.pairwise_distances_backward(grad.float().contiguous(), a32, b32, dist32,
                                                                     ctx.p, False)
        return grad_a.to(a.dtype), grad_b.to(b.dtype), None, None
    grad_a, grad_b = torch.ops.fused.pairwise_distances_backward(grad.contiguous(), a, b, dist, ctx.p, ctx.squared)
    return grad_a, grad_b, None, None


torch.library.register_autograd("fused::pairwise_distances", _distances_backward, setup_context=_distances_setup)


def _topk_setup(ctx, inputs, output):
    a, b, k, p, squared, largest = inputs
    values, indices = output
    ctx.mark_non_differentiable(indices)
    ctx.save_for_backward(a, b, values, indices)
    ctx.p, ctx.squared = p, squared


def _topk_backward(ctx, grad_values, grad_indices):
    a, b, values, indices = ctx.saved_tensors
    if _rounded_max_norm(a, ctx.p):  # the selected pairs' distances recomputed in float32
        a32, b32 = a.float(), b.float()
        batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
        (n, d), m, k = a.shape[-2:], b.shape[-2], indices.shape[-1]
        flat = indices.reshape(*batch, n * k, 1).expand(*batch, n * k, d)
        rows = torch.gather(b32.expand(*batch, m, d), -2, flat).reshape(*batch, n, k, d)
        values32 = (a32.expand(*batch, n, d).unsqueeze(-2) - rows).abs().amax(-1)
        grad_a, grad_b = torch.ops.fused.pairwise_topk_backward(grad_values.float().contiguous(), a32, b32, values32,
                                                                indices, ctx.p, False)
        return grad_a.to(a.dtype), grad_b.to(b.dtype), None, None, None, None
    grad_a, grad_b = torch.ops.fused.pairwise_topk_backward(grad_values.contiguous(), a, b, values, indices,
                                                            ctx.p, ctx.squared)
    return grad_a, grad_b, None, None, None, None


torch.library.register_autograd("fused::pairwise_topk", _topk_backward, setup_context=_topk_setup)


# ---- CUDA tensors ----
# pairwise_distances: the CUDA C++ kernel is the direct path; p = 2 at D >= 32 (not float64) is the tensor-core
# path, which is Triton's, whichever backend is set (the path depends on (p, D, dtype) only). The backward has
# both implementations; pairwise_topk and its backward are Triton only.
def _tensor_core_path(a, b, p=2.0, squared=False):
    return p == 2 and a.shape[-1] >= MATMUL_MIN_D and a.dtype != torch.float64


register_gpu("pairwise_distances", cuda_op="cuda_pairwise_distances", triton=f"{TRITON}:pairwise_distances",
             triton_when=_tensor_core_path)
register_gpu("pairwise_distances_backward", cuda_op="cuda_pairwise_distances_backward",
             triton=f"{TRITON}:pairwise_distances_backward")
for _op in ("pairwise_topk", "pairwise_topk_backward"):
    register_gpu(_op, cuda_op=None, triton=f"{TRITON}:{_op}")
