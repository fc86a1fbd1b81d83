"""Plain-PyTorch references of the distance family (the spec): direct differences, math in float32 (float64
for float64), output in the input dtype. They build the B x N x M x D difference tensor: small inputs only."""
import torch


def _math(t):
    return t.to(torch.float64 if t.dtype == torch.float64 else torch.float32)


def pairwise_distances(a, b, p=2.0, squared=False):
    """||a_i - b_j||_p for every pair, batch dims broadcast; the p-th power's sum for squared=True (p=2)."""
    diff = _math(a).unsqueeze(-2) - _math(b).unsqueeze(-3)  # [*B, N, M, D]
    if squared:
        out = diff.square().sum(-1)
    elif p == 0:
        out = torch.minimum(diff.abs().ceil(), torch.ones_like(diff)).sum(-1)  # NaN stays NaN, like cdist
    else:
        out = torch.linalg.vector_norm(diff, ord=p, dim=-1)
    return out.to(a.dtype)


def pairwise_topk(a, b, k, p=2.0, squared=False, largest=False):
    """The k smallest (largest) distances of each row of a to the rows of b, sorted, ties to the lower index."""
    d = pairwise_distances(a, b, p, squared)
    # A stable sort keeps equal values in index order; NaN sorts last ascending (first when largest).
    key = d.float() if d.dtype in (torch.float16, torch.bfloat16) else d
    if largest:
        order = torch.sort(key, dim=-1, descending=True, stable=True).indices
    else:
        order = torch.sort(key, dim=-1, stable=True).indices
    idx = order[..., :k]
    return d.gather(-1, idx), idx
