"""The fused distance family: all-pairs distances like torch.cdist, k-nearest neighbours without the N x M matrix,
and the point-cloud ops built on them (radius neighbours, chamfer distance). Padded batches follow PyTorch3D's
convention: lengths_a / lengths_b give each cloud's valid row count (int64, the batch shape of a / b)."""

from typing import Optional, Tuple, Union

import torch

from fused._autocast import autocast_float32
from fused.distance import ops as _ops  # fake kernels, autograd, GPU routing; the ops' eager entry points

Tensor = torch.Tensor


def pairwise_distances(
    a: Tensor,
    b: Tensor,
    p: float = 2.0,
    squared: bool = False,
    *,
    lengths_a: Optional[Tensor] = None,
    lengths_b: Optional[Tensor] = None,
) -> Tensor:
    """||a_i - b_j||_p for all pairs: [*B, N, D] x [*B, M, D] -> [*B, N, M], batch dims broadcast, like
    torch.cdist. p in [0, inf]; squared=True (p=2 only) skips the root. Small D uses direct differences (exact
    zeros at duplicates, zero gradient there); p=2 at large D a matmul with the small distances recomputed
    directly. Accumulates in float32 (float64 for float64), returns the input dtype. Pairs with a padded row
    (past lengths_a or lengths_b) are 0 and get no gradient."""
    a, b = autocast_float32("distance", a, b)
    return _ops.pairwise_distances(a, b, p, squared, lengths_a, lengths_b)


def pairwise_topk(
    a: Tensor,
    b: Tensor,
    k: int,
    p: float = 2.0,
    squared: bool = False,
    largest: bool = False,
    *,
    lengths_a: Optional[Tensor] = None,
    lengths_b: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """The k nearest (largest=True: farthest) rows of b for each row of a: (values [*B, N, k], indices int64),
    sorted, ties to the lower index. Distances and selection are fused: memory O((N + M) D + N k), never the
    N x M matrix. Gradients flow through the selected pairs. A row of a never picks a padded row of b; slots
    without a neighbour (fewer than k valid rows in b, or a padded row of a) hold index -1 and value inf (-inf when
    largest, so that the values stay sorted)."""
    a, b = autocast_float32("distance", a, b)
    return _ops.pairwise_topk(a, b, k, p, squared, largest, lengths_a, lengths_b)


def radius_neighbors(
    a: Tensor,
    b: Tensor,
    radius: float,
    max_neighbors: int,
    *,
    lengths_a: Optional[Tensor] = None,
    lengths_b: Optional[Tensor] = None,
    p: float = 2.0,
) -> Tuple[Tensor, Tensor]:
    """For each row of a, the nearest up to max_neighbors rows of b within radius (distance <= radius):
    (values [*B, N, max_neighbors], indices int64), sorted by distance, ties to the lower index, padded with
    index -1 and value inf. pairwise_topk's kernels with the radius as the initial bound: the same answer on
    every device and run, never the N x M matrix. Gradients flow through the returned distances."""
    a, b = autocast_float32("distance", a, b)
    return _ops.radius_neighbors(a, b, radius, max_neighbors, lengths_a, lengths_b, p)


def chamfer_distance(
    a: Tensor,
    b: Tensor,
    *,
    lengths_a: Optional[Tensor] = None,
    lengths_b: Optional[Tensor] = None,
    p: float = 2.0,
    squared: bool = True,
    reduction: str = "mean",
    single_directional: bool = False,
    return_indices: bool = False,
) -> Union[Tensor, Tuple[Tensor, ...]]:
    """The chamfer distance of point clouds a [*B, N, D] and b [*B, M, D]: per cloud, the mean (reduction="sum":
    the sum) over its valid points of the distance to the nearest valid point of the other cloud, a to b plus b
    to a (a to b only when single_directional), then the mean over the batch. PyTorch3D's chamfer_distance
    (point_reduction=reduction, batch_reduction="mean"; its norm=2 is our default squared=True, its norm=1 is
    p=1.0, squared=False): the mean divides by each cloud's own length, points whose other cloud is empty
    count 0. Two fused nearest-neighbour searches (pairwise_topk, k = 1): memory O((N + M) D), never N x M;
    the backward goes through the nearest pairs, deterministic. return_indices=True returns
    (loss, indices_a, indices_b): the nearest point of b for each row of a [*B, N] and of a for each row of b
    [*B, M] (-1 for padded rows and empty clouds); (loss, indices_a) when single_directional."""
    loss, idx_a, idx_b = torch.ops.fused.chamfer_distance(
        a, b, lengths_a, lengths_b, p, squared, reduction, single_directional
    )
    if not return_indices:
        return loss
    return (loss, idx_a) if single_directional else (loss, idx_a, idx_b)


__all__ = ["pairwise_distances", "pairwise_topk", "radius_neighbors", "chamfer_distance"]
