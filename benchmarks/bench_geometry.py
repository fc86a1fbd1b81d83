"""Benchmark cases of the point-cloud ops built on the distance kernels: fused.chamfer_distance (forward, and
forward + backward) and fused.radius_neighbors, against what users write without them: cdist + min for the chamfer
distance, cdist + mask + topk for radius neighbours (eager, and compiled). Points uniform in the unit cube."""

import math

import torch

import fused
from benchmarks.common import forward_and_backward, our_labels, with_backend

MAX_NEIGHBORS = 32


def eager_chamfer(a, b):
    """PyTorch3D's default chamfer distance: squared distances, the mean over each cloud, the mean over the batch."""
    d = torch.cdist(a, b).square()
    return (d.amin(-1).mean(-1) + d.amin(-2).mean(-1)).mean()


def eager_radius_neighbors(a, b, radius):
    """The nearest MAX_NEIGHBORS points within radius, sorted, index -1 and value inf where there is none."""
    d = torch.cdist(a, b)
    v, i = d.masked_fill(d > radius, math.inf).topk(MAX_NEIGHBORS, largest=False)
    return v, i.masked_fill(v == math.inf, -1)


def shapes(device, quick):
    """(batch, points per cloud) of the chamfer cases, and (points, radius) of each radius case: about 35 points
    of the cloud within the radius on average, so that rows fill their MAX_NEIGHBORS slots and some have fewer.
    The last radius case is make bench's default (on a 2-core CPU the 16384-point one takes a minute and a half)."""
    if quick:
        return (2, 512), [(2048, 0.16)]
    if device == "cpu":
        return (8, 4096), [(16384, 0.08), (8192, 0.1)]
    return (32, 8192), [(65536, 0.05)]


def ours(device):
    return our_labels(
        device, lambda: fused.chamfer_distance(torch.ones(1, 2, 3, device=device), torch.ones(1, 2, 3, device=device))
    )


def cases(device: str, quick: bool) -> list:
    out = []
    g = torch.Generator(device=device).manual_seed(0)
    (batch, n), radius_shapes = shapes(device, quick)

    a = torch.rand(batch, n, 3, device=device, generator=g)
    b = torch.rand(batch, n, 3, device=device, generator=g)
    io_bytes = 2 * batch * n * 3 * a.element_size()
    flops = 3 * batch * n * n * 3  # sub, mul, add per pair and coordinate, one pass over the pairs
    shape = f"B={batch} {n}x{n} D=3 float32"
    compiled = torch.compile(eager_chamfer)
    impls = {"eager": lambda: eager_chamfer(a, b), "torch.compile": lambda c=compiled: c(a, b)}
    for label, backend in ours(device).items():
        impls[label] = with_backend(backend, lambda: fused.chamfer_distance(a, b))
    out.append(
        {"name": f"chamfer_distance {shape} fwd", "bytes": io_bytes, "flops": flops, "impls": impls, "default": True}
    )

    ag, bg = a.clone().requires_grad_(), b.clone().requires_grad_()
    grad = torch.ones((), device=device)
    impls = {"eager": forward_and_backward(eager_chamfer, (ag, bg), grad)}
    for label, backend in ours(device).items():
        impls[label] = with_backend(backend, forward_and_backward(fused.chamfer_distance, (ag, bg), grad))
    out.append({"name": f"chamfer_distance {shape} fwd+bwd", "bytes": 2 * io_bytes, "flops": flops, "impls": impls})

    compiled = torch.compile(eager_radius_neighbors)
    for n_radius, radius in radius_shapes:
        p = torch.rand(n_radius, 3, device=device, generator=g)
        q = torch.rand(n_radius, 3, device=device, generator=g)
        impls = {
            "eager": lambda p=p, q=q, r=radius: eager_radius_neighbors(p, q, r),
            "torch.compile": lambda p=p, q=q, r=radius: compiled(p, q, r),
        }
        for label, backend in ours(device).items():
            impls[label] = with_backend(
                backend, lambda p=p, q=q, r=radius: fused.radius_neighbors(p, q, r, MAX_NEIGHBORS)
            )
        out.append(
            {
                "name": f"radius_neighbors {n_radius}x{n_radius} D=3 r={radius} max {MAX_NEIGHBORS} float32",
                "bytes": 2 * n_radius * 3 * 4 + n_radius * MAX_NEIGHBORS * 12,
                "flops": 3 * n_radius * n_radius * 3,
                "impls": impls,
                "default": n_radius == radius_shapes[-1][0],
            }
        )
    return out
