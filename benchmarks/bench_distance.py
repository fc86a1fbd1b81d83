"""Benchmark cases of the fused distance family: all-pairs distances (forward, forward+backward) and k nearest
neighbours, against the broadcasting formula (eager, and compiled), torch.cdist in both compute modes, cdist + topk,
and faiss's exact search (faiss-cpu's IndexFlatL2, where it imports: an optional dependency; built and searched per
call as our op runs, and searched alone against an index built once). Cases marked
"default" are the ones `make bench` times; FULL=1 times them all."""

import torch

try:
    import faiss
except ImportError:  # optional: its rows are left out
    faiss = None

import fused
from benchmarks.common import forward_and_backward, our_labels, with_backend

K = 16
# The broadcasting formula materialises B x N x M x D: run it only where that stays under 1 GiB.
EAGER_LIMIT = 2**30


def eager_distances(a, b):
    return ((a[..., :, None, :] - b[..., None, :, :]) ** 2).sum(-1).sqrt()


def eager_topk(a, b, k=K):
    return eager_distances(a, b).topk(k, largest=False)


def cdist_mm(a, b):
    return torch.cdist(a, b)  # default: matmul for N or M > 25


def cdist_direct(a, b):
    return torch.cdist(a, b, compute_mode="donot_use_mm_for_euclid_dist")


def cdist_topk(a, b, k=K):
    return torch.cdist(a, b).topk(k, largest=False)


def faiss_topk(a, b, k=K):
    """faiss's exact k-NN on the CPU: the index (a copy of b) built and searched, as a user runs it once."""
    index = faiss.IndexFlatL2(b.shape[1])
    index.add(b.numpy())
    return index.search(a.numpy(), k)


def faiss_prebuilt(b):
    """faiss's exact k-NN against an index built once (outside the timing), as a user runs repeated queries."""
    index = faiss.IndexFlatL2(b.shape[1])
    index.add(b.numpy())
    return lambda a, k=K: index.search(a.numpy(), k)


def topk_shapes(device, quick):
    """(N, M, D, k, clustered): the point-cloud size (D = 3) and embedding sizes (D = 64 to 768), as issue 22
    measured them, and embeddings in clusters (every point of a cluster near the k-th distance of its members)."""
    if quick:
        return [(256, 1024, 3, K, False), (256, 1024, 64, K, False)]
    return [
        (16384, 16384, 3, K, False),
        (4096, 65536, 64, K, False),
        (4096, 65536, 128, 10, False),
        (2048, 100000, 96, 1, False),
        (2048, 32768, 768, K, False),
        (2048, 32768, 768, K, True),
        (16, 32768, 768, K, False),
    ]


def clustered_points(n, m, d, device, generator, clusters=100):
    """a [n, d] and b [m, d] drawn around the same `clusters` centers (spread 10, each cluster 0.1 wide)."""
    centers = 10 * torch.randn(clusters, d, device=device, generator=generator)

    def around(rows):
        pick = torch.randint(0, clusters, (rows,), device=device, generator=generator)
        return centers[pick] + 0.1 * torch.randn(rows, d, device=device, generator=generator)

    return around(n), around(m)


def shapes(device, quick):
    if quick:
        return [(100, 200, 2), (256, 512, 64)]
    if device == "cpu":
        return [(100, 200, 2), (2048, 4096, 3), (2048, 4096, 64)]
    return [
        (100, 200, 2),
        (2048, 4096, 3),
        (2048, 4096, 64),
        (16384, 16384, 3),
        (16384, 16384, 64),
        (16384, 16384, 256),
    ]


def ours(device):
    return our_labels(
        device, lambda: fused.pairwise_distances(torch.ones(2, 3, device=device), torch.ones(2, 3, device=device))
    )


def cases(device: str, quick: bool) -> list:
    out = []
    g = torch.Generator(device=device).manual_seed(0)
    for n, m, d in shapes(device, quick):
        a = torch.randn(n, d, device=device, generator=g)
        b = torch.randn(m, d, device=device, generator=g)
        size = a.element_size()
        io_bytes = (n + m) * d * size
        flops = 3 * n * m * d  # sub, mul, add per pair and coordinate
        small = n * m * d * size <= EAGER_LIMIT
        shape = f"({n},{d})x({m},{d}) float32"

        impls = {}
        if small:
            compiled = torch.compile(eager_distances)
            impls["eager"] = lambda a=a, b=b: eager_distances(a, b)
            impls["torch.compile"] = lambda a=a, b=b, c=compiled: c(a, b)
        impls["torch.cdist"] = lambda a=a, b=b: cdist_mm(a, b)
        impls["torch.cdist[direct]"] = lambda a=a, b=b: cdist_direct(a, b)
        for label, backend in ours(device).items():
            impls[label] = with_backend(backend, lambda a=a, b=b: fused.pairwise_distances(a, b))
        out.append(
            {
                "name": f"pairwise_distances {shape} fwd",
                "bytes": io_bytes + n * m * size,
                "flops": flops,
                "impls": impls,
                "default": d == 64,
            }
        )

        ag, bg = a.clone().requires_grad_(), b.clone().requires_grad_()
        grad = torch.randn(n, m, device=device, generator=g)
        impls = {}
        if small:
            impls["eager"] = forward_and_backward(eager_distances, (ag, bg), grad)
        impls["torch.cdist"] = forward_and_backward(cdist_mm, (ag, bg), grad)
        impls["torch.cdist[direct]"] = forward_and_backward(cdist_direct, (ag, bg), grad)
        for label, backend in ours(device).items():
            impls[label] = with_backend(backend, forward_and_backward(fused.pairwise_distances, (ag, bg), grad))
        # fwd + bwd: inputs read twice, grad read, distances written then read, gradients written.
        out.append(
            {
                "name": f"pairwise_distances {shape} fwd+bwd",
                "bytes": 3 * io_bytes + 3 * n * m * size,
                "flops": 3 * flops,
                "impls": impls,
            }
        )

    for n, m, d, k, clustered in topk_shapes(device, quick):
        if clustered:
            a, b = clustered_points(n, m, d, device, g)
        else:
            a = torch.randn(n, d, device=device, generator=g)
            b = torch.randn(m, d, device=device, generator=g)
        size = a.element_size()
        impls = {}
        if n * m * d * size <= EAGER_LIMIT:
            impls["eager"] = lambda a=a, b=b, k=k: eager_topk(a, b, k)
        if n * m * size <= EAGER_LIMIT // 4:  # the N x M matrix: 256 MB at most
            impls["torch.cdist+topk"] = lambda a=a, b=b, k=k: cdist_topk(a, b, k)
        if faiss is not None and device == "cpu":
            impls["faiss IndexFlatL2"] = lambda a=a, b=b, k=k: faiss_topk(a, b, k)
            impls["faiss IndexFlatL2, prebuilt"] = lambda a=a, k=k, search=faiss_prebuilt(b): search(a, k)
        for label, backend in ours(device).items():
            impls[label] = with_backend(backend, lambda a=a, b=b, k=k: fused.pairwise_topk(a, b, k))
        out.append(
            {
                "name": f"pairwise_topk k={k} ({n},{d})x({m},{d}) float32{' clustered' if clustered else ''} fwd",
                "bytes": (n + m) * d * size + n * k * (size + 8),
                "flops": 2 * n * m * d,
                "impls": impls,
                "default": d == 64,
            }
        )
    return out
