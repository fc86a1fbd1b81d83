"""The fused distance family: all-pairs distances like torch.cdist, and k-nearest neighbours without the
N x M matrix."""
from typing import Tuple

import torch

from fused.distance import ops as _ops  # noqa: F401  fake kernels, autograd, GPU routing


def pairwise_distances(a: torch.Tensor, b: torch.Tensor, p: float = 2.0, squared: bool = False) -> torch.Tensor:
    """||a_i - b_j||_p for all pairs: [*B, N, D] x [*B, M, D] -> [*B, N, M], batch dims broadcast, like
    torch.cdist. p in [0, inf]; squared=True (p=2 only) skips the root. Small D uses direct differences (exact
    zeros at duplicates, zero gradient there); p=2 at large D a matmul with the small distances recomputed
    directly. Accumulates in float32 (float64 for float64), returns the input dtype."""
    return torch.ops.fused.pairwise_distances(a, b, p, squared)


def pairwise_topk(a: torch.Tensor, b: torch.Tensor, k: int, p: float = 2.0, squared: bool = False,
                  largest: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """The k nearest (largest=True: farthest) rows of b for each row of a: (values [*B, N, k], indices int64),
    sorted, ties to the lower index. Distances and selection are fused: memory O((N + M) D + N k), never the
    N x M matrix. Gradients flow through the selected pairs."""
    return torch.ops.fused.pairwise_topk(a, b, k, p, squared, largest)


__all__ = ["pairwise_distances", "pairwise_topk"]
