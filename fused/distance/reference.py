"""Plain-PyTorch references of the distance family (the spec): direct differences, math in float32 (float64
for float64), output in the input dtype. They build the B x N x M x D difference tensor: small inputs only.
lengths_a / lengths_b: a padded batch's valid row counts (the batch shape of a / b)."""

import math

import torch


def _math(t):
    return t.to(torch.float64 if t.dtype == torch.float64 else torch.float32)


def _valid(lengths, t, batch):
    """[*B, rows] mask of the valid rows of t (all rows without lengths)."""
    rows = torch.arange(t.shape[-2], device=t.device)
    if lengths is None:
        return torch.ones((*batch, t.shape[-2]), dtype=torch.bool, device=t.device)
    return rows < lengths.expand(batch)[..., None]


def _pair_mask(a, b, lengths_a, lengths_b):
    """[*B, N, M]: True where both rows are valid."""
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    return _valid(lengths_a, a, batch)[..., :, None] & _valid(lengths_b, b, batch)[..., None, :]


def pairwise_distances(a, b, p=2.0, squared=False, lengths_a=None, lengths_b=None):
    """||a_i - b_j||_p for every pair, batch dims broadcast; the p-th power's sum for squared=True (p=2); 0 where
    either row is padding."""
    diff = _math(a).unsqueeze(-2) - _math(b).unsqueeze(-3)  # [*B, N, M, D]
    if squared:
        out = diff.square().sum(-1)
    elif p == 0:
        out = torch.minimum(diff.abs().ceil(), torch.ones_like(diff)).sum(-1)  # NaN stays NaN, like cdist
    else:
        out = torch.linalg.vector_norm(diff, ord=p, dim=-1)
    out = torch.where(_pair_mask(a, b, lengths_a, lengths_b), out, 0.0)
    return out.to(a.dtype)


def select_sorted(d, valid, k, largest=False):
    """The first k of each row of d in selection order among the valid entries (a stable sort: ties to the lower
    index; NaN last, or first when largest, as torch.topk ranks it), then the rest as missing: index -1, value
    inf (-inf when largest); k may exceed the row length."""
    pad = max(k - d.shape[-1], 0)
    d = torch.nn.functional.pad(d, (0, pad))
    valid = torch.nn.functional.pad(valid, (0, pad))
    key = d.float() if d.dtype in (torch.float16, torch.bfloat16) else d
    order = torch.sort(key, dim=-1, descending=largest, stable=True).indices
    order = order.gather(-1, torch.sort((~valid).gather(-1, order).byte(), dim=-1, stable=True).indices)
    idx = order[..., :k]
    ok = valid.gather(-1, idx)
    missing = -math.inf if largest else math.inf
    return torch.where(ok, d.gather(-1, idx), missing), torch.where(ok, idx, -1)


def pairwise_topk(a, b, k, p=2.0, squared=False, largest=False, lengths_a=None, lengths_b=None):
    """The k smallest (largest) distances of each row of a to the valid rows of b, sorted, ties to the lower
    index; missing neighbours: index -1, value inf (-inf when largest)."""
    d = pairwise_distances(a, b, p, squared)
    return select_sorted(d, _pair_mask(a, b, lengths_a, lengths_b), k, largest)


def radius_neighbors(a, b, radius, max_neighbors, lengths_a=None, lengths_b=None, p=2.0):
    """The nearest up to max_neighbors valid rows of b with distance <= radius, sorted, ties to the lower index,
    padded with index -1 and value inf."""
    d = pairwise_distances(a, b, p)
    within = d.double() <= radius  # exactly: torch would round the radius to a 16-bit d's dtype
    return select_sorted(d, _pair_mask(a, b, lengths_a, lengths_b) & within, max_neighbors)


def chamfer_distance(
    a, b, lengths_a=None, lengths_b=None, p=2.0, squared=True, reduction="mean", single_directional=False
):
    """cdist + masks + min: per cloud, the sum (mean over its length) of each valid point's distance to the
    nearest valid point of the other cloud (0 when that cloud is empty), a to b plus b to a, then the mean over
    the batch."""
    d = _math(pairwise_distances(_math(a), _math(b), p, squared))
    mask = _pair_mask(a, b, lengths_a, lengths_b)

    def one_way(d, mask, lengths, rows):
        nearest = torch.where(mask, d, math.inf).amin(-1) if d.shape[-1] else d.new_full(d.shape[:-1], math.inf)
        total = torch.where(mask.any(-1), nearest, 0.0).sum(-1)
        if reduction == "sum":
            return total
        return total / (lengths.clamp(min=1) if lengths is not None else max(rows, 1))

    loss = one_way(d, mask, lengths_a, a.shape[-2])
    if not single_directional:
        loss = loss + one_way(d.transpose(-1, -2), mask.transpose(-1, -2), lengths_b, b.shape[-2])
    return loss.mean().to(a.dtype)
