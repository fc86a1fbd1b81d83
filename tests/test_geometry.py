"""Point-cloud geometry on the distance kernels: fused.radius_neighbors and fused.chamfer_distance, against the
references of fused/distance/reference.py (cdist + masks + min / sort) and float64, on random clouds, clouds with
duplicates and exact ties, padded batches (lengths of 0 and 1, all-padded rows), radius 0 and inf, max_neighbors
past M, non-contiguous inputs; gradients (gradcheck in float64), opcheck, torch.compile, bad input, and the Triton
launchers under the interpreter.

Ported from PyTorch3D (facebookresearch/pytorch3d, tests/test_knn.py and tests/test_chamfer.py; normals and
per-cloud weights left out, as our API has neither): test_knn_vs_python_cpu_square, test_knn_vs_python_cpu_ragged
(pairwise_topk with squared=True is knn_points; K past the longest cloud runs as radius_neighbors with radius inf),
test_chamfer_point_batch_reduction_mean, test_chamfer_vs_naive_pointcloud and its single-directional twin,
test_chamfer_point_reduction_sum and its single-directional twin, test_chamfer_joint_reduction (the point
reductions with the batch mean), test_empty_clouds, test_incorrect_inputs and test_invalid_norm (as our errors).
PyTorch3D's knn leaves 0 in the slots it has no neighbour for; ours hold index -1 and value inf, which the ported
cases check instead."""

import itertools
import math

import pytest
import torch

import fused
from fused.distance import reference as ref
from fused.distance.ops import MATMUL_MIN_D
from tests.harness import (
    ALL_DTYPES,
    FLOAT_DTYPES,
    HAS_CUDA,
    HAS_TRITON,
    assert_accuracy,
    assert_close,
    check_compile,
    check_compile_grads,
    given,
    make,
    noncontiguous,
    raises,
    requires_triton,
    settings,
    st,
)


def padded(n_rows, lengths, D, dtype=torch.float32, device="cpu", seed=0, nan_padding=True):
    """A padded batch [len(lengths), n_rows, D] whose padded rows hold NaN (they must never be read)."""
    t = make((len(lengths), n_rows, D), dtype, device, seed=seed)
    lengths = torch.tensor(lengths, device=device)
    if nan_padding:
        for i, n in enumerate(lengths.tolist()):
            t[i, n:] = math.nan
    return t, lengths


def clean(t, lengths):
    """t with its padded rows zeroed (for references that read every row)."""
    valid = torch.arange(t.shape[-2], device=t.device) < lengths[:, None]
    return torch.where(valid[..., None], t, 0.0)


def radius64(a, b, radius, k, lengths_a=None, lengths_b=None):
    """radius_neighbors as a float64 search (p = 2): the valid rows of b whose float64 distance, rounded once to
    a's dtype, is <= radius, the nearest k by that float64 distance (ties to the lower index), values rounded once."""
    d = ref.pairwise_distances(a.double(), b.double())
    within = ref._pair_mask(a, b, lengths_a, lengths_b) & (d.to(a.dtype).double() <= radius)
    v, i = ref.select_sorted(d, within, k)
    return v.to(a.dtype), i


def assert_values64(v, rv):
    """Values rounded once from float64: bitwise, but in float64 itself, where the sums' orders differ."""
    if v.dtype == torch.float64:
        torch.testing.assert_close(v, rv, rtol=1e-14, atol=0)
    else:
        assert torch.equal(v, rv)


# ---- radius_neighbors ----
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("D", [3, 40])  # D = 40: the matmul path for p = 2 (direct for the others)
@pytest.mark.parametrize("p", [2.0, 1.0, math.inf])
def test_radius_neighbors_parity(dev, dtype, D, p):
    a, b = make((2, 30, D), dtype, dev, seed=1), make((2, 50, D), dtype, dev, seed=2)
    radius = torch.quantile(ref.pairwise_distances(a.double(), b.double(), p).flatten(), 0.08).item()  # ~4 of 50
    v, i = fused.radius_neighbors(a, b, radius, 8, p=p)
    rv, ri = ref.radius_neighbors(a, b, radius, 8, p=p)
    assert v.shape == i.shape == (2, 30, 8) and v.dtype == dtype and i.dtype == torch.int64
    assert ((i >= 0).sum(-1) > 0).any() and (i == -1).any()  # some rows have neighbours, some slots are empty
    assert torch.equal(v == math.inf, i == -1)
    assert (v[i >= 0].double() <= radius).all()
    tv, ti = fused.pairwise_topk(a, b, 8, p)
    if dev == "cpu" and p == 2 and D >= MATMUL_MIN_D:  # the GEMM path re-ranks exactly: a float64 search
        sv, si = radius64(a, b, radius, 8)
        assert torch.equal(i, si)
        assert_values64(v, sv)
    else:
        d = fused.pairwise_distances(a, b, p)  # the selection of our own distances (the same tiles): exact
        sv, si = ref.select_sorted(d, d.double() <= radius, 8)
        if dev == "cpu":
            assert torch.equal(i, si) and torch.equal(v, sv)
        else:
            assert_close(v, sv)
    within = torch.where(tv.double() <= radius, ti, -1)  # within the radius: the k nearest
    assert torch.equal(within, i)
    if dtype in (torch.float32, torch.float64):  # 16-bit distances a rounding away from the radius may flip
        assert_close(v, rv)
        assert torch.equal(i, ri)


def test_radius_neighbors_bounds():
    """radius 0: only duplicates; radius inf: every valid point (NaN distances never); max_neighbors past M."""
    a = make((20, 3), seed=3)
    b = torch.cat([a[:5], make((30, 3), seed=4), a[:2]])  # duplicates of a[0] and a[1] at 0 and 35, 1 and 36
    v, i = fused.radius_neighbors(a, b, 0.0, 4)
    assert i[0].tolist() == [0, 35, -1, -1] and i[1].tolist() == [1, 36, -1, -1] and i[2].tolist() == [2, -1, -1, -1]
    assert (v[:2, :2] == 0).all() and (i[5:] == -1).all()
    b[7, 1] = math.nan
    v, i = fused.radius_neighbors(a, b, math.inf, 40)
    assert v.shape == (20, 40)
    assert (i[:, :36] >= 0).all() and (i[:, 36:] == -1).all() and not (i == 7).any()
    rv, ri = ref.radius_neighbors(a, b, math.inf, 40)
    assert torch.equal(i, ri)
    assert_close(v, rv)


def test_radius_neighbors_ties_go_to_the_lower_index():
    grid = torch.tensor([[0.0, 0.0], [1.0, 1.0]])
    pts = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [0.0, 0.0], [0.0, -1.0], [2.0, 2.0]])
    v, i = fused.radius_neighbors(grid, pts, 1.0, 6)
    assert i.tolist() == [[3, 0, 1, 2, 4, -1], [0, 1, -1, -1, -1, -1]]
    assert v[0].tolist() == [0.0, 1.0, 1.0, 1.0, 1.0, math.inf]


def test_radius_is_compared_exactly():
    """The radius bound is <= on the returned (rounded) distance, whatever the radius' rounding in float32."""
    a = torch.zeros(1, 1)
    b = torch.tensor([[0.1], [0.2], [0.30000001192092896], [0.3], [0.4]])  # float32(0.3) = 0.30000001192...
    assert fused.radius_neighbors(a, b, 0.3, 5)[1].tolist() == [[0, 1, -1, -1, -1]]  # 0.3 (float32) > 0.3
    assert fused.radius_neighbors(a, b, 0.30000001192092896, 5)[1].tolist() == [[0, 1, 2, 3, -1]]
    b64 = torch.tensor([[0.1], [0.2], [0.30000001192092896], [0.3], [0.4]], dtype=torch.float64)
    assert fused.radius_neighbors(a.double(), b64, 0.3, 5)[1].tolist() == [[0, 1, 3, -1, -1]]


def test_radius_neighbors_padded_batches():
    a, la = padded(12, [12, 1, 0], 3, seed=5)
    b, lb = padded(15, [15, 6, 9], 3, seed=6)
    v, i = fused.radius_neighbors(a, b, 2.0, 20, lengths_a=la, lengths_b=lb)
    rv, ri = ref.radius_neighbors(clean(a, la), clean(b, lb), 2.0, 20, lengths_a=la, lengths_b=lb)
    assert torch.equal(i, ri)
    assert_close(v, rv)
    assert (i[1, 1:] == -1).all() and (i[2] == -1).all() and (i[1, 0, 6:] == -1).all() and not v.isnan().any()


def test_radius_neighbors_noncontiguous():
    a, b = make((3, 20, 3), seed=7), make((3, 25, 3), seed=8)
    expected = fused.radius_neighbors(a, b, 1.5, 6)
    for x, y in ((noncontiguous(a), noncontiguous(b)), (a.transpose(-1, -2).contiguous().transpose(-1, -2), b)):
        got = fused.radius_neighbors(x, y, 1.5, 6)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


@pytest.mark.parametrize("p", [2.0, 1.0, 3.0])
def test_radius_neighbors_gradients(p):
    """Gradients flow through the returned distances (not through missing slots); gradcheck in float64."""
    a = make((2, 6, 3), torch.float64, seed=9, requires_grad=True)
    b = make((2, 9, 3), torch.float64, seed=10, requires_grad=True)
    v, i = fused.radius_neighbors(a, b, 2.5, 5, p=p)
    assert (i == -1).any() and (i >= 0).any()
    g = make(v.shape, torch.float64, seed=11)
    ours = torch.autograd.grad(v, (a, b), g)
    rv = ref.pairwise_distances(a, b, p).gather(-1, i.clamp(min=0))
    theirs = torch.autograd.grad(rv, (a, b), torch.where(i >= 0, g, 0.0))
    for o, t in zip(ours, theirs):
        assert_close(o, t)
    assert torch.autograd.gradcheck(
        lambda x, y: fused.radius_neighbors(x, y, 2.5, 5, p=p)[0].nan_to_num(posinf=0.0), (a, b)
    )


def test_radius_neighbors_duplicates_give_zero_gradient_not_nan():
    a = make((5, 3), torch.float64, seed=12, requires_grad=True)
    b = torch.cat([a.detach(), make((4, 3), torch.float64, seed=13)]).requires_grad_()
    v, i = fused.radius_neighbors(a, b, 1.0, 3)
    assert (v[:, 0] == 0).all()
    ga, gb = torch.autograd.grad(v[:, 0].sum(), (a, b))
    assert torch.equal(ga, torch.zeros_like(ga)) and torch.equal(gb, torch.zeros_like(gb))


def test_radius_neighbors_is_deterministic_across_thread_counts():
    a, b = make((400, 3), seed=14), make((300, 3), seed=15)
    results = []
    old = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append(fused.radius_neighbors(a, b, 1.0, 16))
    finally:
        torch.set_num_threads(old)
    assert torch.equal(results[0][1], results[1][1]) and torch.equal(results[0][0], results[1][0])


# p = 2 at D >= MATMUL_MIN_D on the CPU: pairwise_topk's GEMM candidates with the radius as the initial bound, then
# the float64 re-rank. Each of these failed when that path ranked the norms formula's float32 values.
@pytest.mark.usefixtures("knn_filter")
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("D", [64, 128])
def test_radius_neighbors_gemm_path_keeps_the_pair_at_the_radius(dtype, D):
    """radius = the distance pairwise_topk returns for a pair: that pair is in, and the answer is pairwise_topk's
    neighbours with values <= radius (indices and values), whatever the GEMM's rounding."""
    a, b = make((6, D), dtype, seed=61), make((50, D), dtype, seed=62)
    tv, ti = fused.pairwise_topk(a, b, 50)
    for t in range(0, 50, 3):
        radius = tv[t % 6, t].item()
        v, i = fused.radius_neighbors(a, b, radius, 50)
        assert ti[t % 6, t] in i[t % 6]
        within = tv.double() <= radius
        assert torch.equal(i, torch.where(within, ti, -1)), t
        assert torch.equal(v, torch.where(within, tv, math.inf)), t


@pytest.mark.usefixtures("knn_filter")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_radius_neighbors_gemm_path_grid_ties(dtype):
    """Points on an integer grid at D = 64 (many exact ties): the indices of a float64 search and of pairwise_topk,
    ties to the lower index, for radius inf and a radius that falls on a distance (sqrt(64) = 8)."""
    g = torch.Generator().manual_seed(63)
    a = torch.randint(0, 3, (40, 64), generator=g).to(dtype)
    b = torch.randint(0, 3, (300, 64), generator=g).to(dtype)
    tv, ti = fused.pairwise_topk(a, b, 20)
    for radius in (math.inf, 8.0):
        v, i = fused.radius_neighbors(a, b, radius, 20)
        rv, ri = radius64(a, b, radius, 20)
        assert torch.equal(i, ri) and torch.equal(v, rv)
        assert torch.equal(i, torch.where(tv.double() <= radius, ti, -1))
        assert (i >= 0).any() and (radius == math.inf or (i == -1).any())


@pytest.mark.usefixtures("knn_filter")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_radius_neighbors_gemm_path_rows_are_independent(dtype):
    """A row's answer at D = 64 does not depend on the other rows of the call (the GEMM's blocking) nor on the
    thread count (few rows split the columns among the threads): the float64 search's, alone or in a batch."""
    a, b = make((300, 64), dtype, seed=64), make((700, 64), dtype, seed=65)
    b[650:] = b[:50]  # exact duplicates: ties far apart, in different column splits
    radius = torch.quantile(ref.pairwise_distances(a[:20].double(), b.double()).flatten(), 0.02).item()
    rv, ri = radius64(a, b, radius, 10)
    assert (ri >= 0).sum() > 300 and (ri == -1).any()
    old = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            v, i = fused.radius_neighbors(a, b, radius, 10)
            assert torch.equal(i, ri), threads
            assert_values64(v, rv)
            for q in range(0, 300, 23):
                vq, iq = fused.radius_neighbors(a[q : q + 1], b, radius, 10)
                assert torch.equal(iq, i[q : q + 1]) and torch.equal(vq, v[q : q + 1]), (threads, q)
    finally:
        torch.set_num_threads(old)


@pytest.mark.usefixtures("knn_filter")
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_radius_neighbors_gemm_path_padded_batches(dtype):
    """lengths_a / lengths_b at D = 64 (padded rows hold NaN, never read): the float64 search of the valid rows."""
    a, la = padded(30, [30, 1, 0, 17], 64, dtype, seed=66)
    b, lb = padded(80, [80, 40, 9, 0], 64, dtype, seed=67)
    radius = torch.quantile(ref.pairwise_distances(clean(a, la)[0].double(), b[0].double()).flatten(), 0.05).item()
    v, i = fused.radius_neighbors(a, b, radius, 12, lengths_a=la, lengths_b=lb)
    rv, ri = radius64(clean(a, la), clean(b, lb), radius, 12, lengths_a=la, lengths_b=lb)
    assert torch.equal(i, ri) and (i[0] >= 0).any() and (i[2:] == -1).all() and (i[1, 1:] == -1).all()
    assert_values64(v, rv)
    tv, ti = fused.pairwise_topk(a, b, 12, lengths_a=la, lengths_b=lb)
    radius = tv[0, :, 3].median().item()  # a pair's distance: that pair is in
    v, i = fused.radius_neighbors(a, b, radius, 12, lengths_a=la, lengths_b=lb)
    within = tv.double() <= radius
    assert torch.equal(i, torch.where(within, ti, -1)) and torch.equal(v, torch.where(within, tv, math.inf))


def test_radius_neighbors_bad_inputs():
    a, b = make((2, 4, 3)), make((2, 5, 3))
    with raises("fused.radius_neighbors: radius must be in"):
        fused.radius_neighbors(a, b, -1.0, 3)
    with raises("fused.radius_neighbors: radius must be in"):
        fused.radius_neighbors(a, b, math.nan, 3)
    with raises("fused.radius_neighbors: max_neighbors must be >= 1, got 0"):
        fused.radius_neighbors(a, b, 1.0, 0)
    with raises("fused.radius_neighbors: lengths_b has a length 6 larger than the padded size 5"):
        fused.radius_neighbors(a, b, 1.0, 3, lengths_b=torch.tensor([6, 1]))
    with raises("fused.radius_neighbors: p must be"):
        fused.radius_neighbors(a, b, 1.0, 3, p=-2.0)
    with raises("fused.radius_neighbors: b has dtype"):
        fused.radius_neighbors(a, b.double(), 1.0, 3)


# ---- chamfer_distance ----
def eager_chamfer(a, b, squared=True):
    """What a user would write in the input dtype: cdist where it takes the dtype, else the broadcast formula, then
    the min both ways."""
    if a.dtype in (torch.float32, torch.float64):
        d = torch.cdist(a, b)
        d = d.square() if squared else d
    else:
        d = (a.unsqueeze(-2) - b.unsqueeze(-3)).square().sum(-1)
        d = d if squared else d.sqrt()
    return (d.amin(-1).mean(-1) + d.amin(-2).mean(-1)).mean()


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("D", [3, 40])
@pytest.mark.parametrize("p,squared", [(2.0, True), (2.0, False), (1.0, False)])
def test_chamfer_parity(dev, dtype, D, p, squared):
    a, b = make((3, 40, D), dtype, dev, seed=20), make((3, 55, D), dtype, dev, seed=21)
    for reduction, single in itertools.product(("mean", "sum"), (False, True)):
        loss = fused.chamfer_distance(a, b, p=p, squared=squared, reduction=reduction, single_directional=single)
        expected = ref.chamfer_distance(a, b, p=p, squared=squared, reduction=reduction, single_directional=single)
        assert loss.shape == () and loss.dtype == dtype
        assert_close(loss, expected, scale=4.0)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_chamfer_accuracy(dtype):
    """Error against float64 no worse than the eager cdist + min chamfer's in the same dtype."""
    a, b = make((2, 200, 3), dtype, seed=22), make((2, 150, 3), dtype, seed=23)
    exact = ref.chamfer_distance(a.double(), b.double())
    assert_accuracy(fused.chamfer_distance(a, b), eager_chamfer(a, b), exact)


def test_chamfer_return_indices():
    """indices_a: the nearest point of b for each row of a (pairwise_topk's, k = 1); indices_b likewise; -1 for
    padded rows and where the other cloud is empty; (loss, indices_a) when single-directional."""
    a, la = padded(10, [10, 3, 0], 3, seed=24)
    b, lb = padded(12, [12, 0, 5], 3, seed=25)
    loss, ia, ib = fused.chamfer_distance(a, b, lengths_a=la, lengths_b=lb, return_indices=True)
    assert ia.shape == (3, 10) and ib.shape == (3, 12) and ia.dtype == ib.dtype == torch.int64
    assert torch.equal(ia, fused.pairwise_topk(a, b, 1, squared=True, lengths_a=la, lengths_b=lb)[1][..., 0])
    assert torch.equal(ib, fused.pairwise_topk(b, a, 1, squared=True, lengths_a=lb, lengths_b=la)[1][..., 0])
    assert (ia[1] == -1).all() and (ia[2] == -1).all() and (ib[1] == -1).all() and (ib[2] == -1).all()
    assert (ia[0] >= 0).all()
    out = fused.chamfer_distance(a, b, lengths_a=la, lengths_b=lb, single_directional=True, return_indices=True)
    assert len(out) == 2 and torch.equal(out[1], ia)
    assert torch.equal(fused.chamfer_distance(a, b, lengths_a=la, lengths_b=lb), loss)


def test_chamfer_padded_batches():
    """Padded rows (NaN here) are never read; each cloud's mean divides by its own length; an empty cloud's mean
    is 0; so are the distances of points whose other cloud is empty (PyTorch3D's convention)."""
    a, la = padded(10, [10, 1, 0, 7], 3, seed=26)
    b, lb = padded(12, [12, 6, 5, 0], 3, seed=27)
    for reduction, single, squared in itertools.product(("mean", "sum"), (False, True), (True, False)):
        loss = fused.chamfer_distance(
            a, b, lengths_a=la, lengths_b=lb, reduction=reduction, single_directional=single, squared=squared
        )
        expected = ref.chamfer_distance(
            clean(a, la), clean(b, lb), la, lb, squared=squared, reduction=reduction, single_directional=single
        )
        assert_close(loss, expected)
    per_cloud = [
        fused.chamfer_distance(a[i : i + 1, :n], b[i : i + 1, :m])
        for i, (n, m) in enumerate(zip(la.tolist(), lb.tolist()))
        if n and m
    ]
    assert_close(
        fused.chamfer_distance(a[:2], b[:2], lengths_a=la[:2], lengths_b=lb[:2]), torch.stack(per_cloud).mean()
    )


def test_chamfer_gradients():
    """Against autograd through the reference (float64), padded rows of a and b get exactly 0; gradcheck."""
    a, la = padded(8, [8, 3, 0], 3, torch.float64, seed=28)
    b, lb = padded(9, [9, 1, 4], 3, torch.float64, seed=29)
    a.requires_grad_(), b.requires_grad_()
    a0, b0 = clean(a, la).detach().requires_grad_(), clean(b, lb).detach().requires_grad_()
    for kw in (
        dict(),
        dict(reduction="sum"),
        dict(single_directional=True),
        dict(p=1.0, squared=False),
        dict(squared=False),
    ):
        ours = torch.autograd.grad(fused.chamfer_distance(a, b, lengths_a=la, lengths_b=lb, **kw), (a, b))
        theirs = torch.autograd.grad(ref.chamfer_distance(a0, b0, la, lb, **kw), (a0, b0))
        for o, t in zip(ours, theirs):
            assert_close(o, t)
        assert not ours[0][1, 3:].any() and not ours[0][2].any() and not ours[1][1, 1:].any()
    x = make((2, 5, 3), torch.float64, seed=30, requires_grad=True)
    y = make((2, 7, 3), torch.float64, seed=31, requires_grad=True)
    lx, ly = torch.tensor([5, 2]), torch.tensor([4, 7])
    for kw in (dict(), dict(squared=False), dict(p=1.0, squared=False), dict(reduction="sum")):
        assert torch.autograd.gradcheck(
            lambda u, w: fused.chamfer_distance(u, w, lengths_a=lx, lengths_b=ly, **kw), (x, y)
        ), kw


def test_chamfer_duplicates_give_zero_loss_and_zero_gradient():
    a = make((2, 30, 3), seed=32, requires_grad=True)
    for squared in (True, False):
        loss = fused.chamfer_distance(a, a.detach()[:, torch.randperm(30)].requires_grad_(), squared=squared)
        assert loss.item() == 0.0
        (g,) = torch.autograd.grad(loss, a)
        assert torch.equal(g, torch.zeros_like(g))  # not NaN (the root's gradient at 0)


def test_chamfer_points_far_from_the_origin():
    """Exact where cdist's matmul path cancels: points near 1e4 with neighbours 1e-2 apart."""
    a = make((1, 100, 3), torch.float64, seed=33) + 1e4
    b = (a + 1e-2 * make((1, 100, 3), torch.float64, seed=34)).float()
    a = a.float()
    exact = ref.chamfer_distance(a.double(), b.double())
    ours = fused.chamfer_distance(a, b)
    assert abs(ours.item() - exact.item()) / exact.item() < 1e-5
    assert_accuracy(ours, eager_chamfer(a, b), exact)


def test_chamfer_noncontiguous_and_broadcast():
    a, b = make((3, 20, 3), seed=35), make((3, 25, 3), seed=36)
    expected = fused.chamfer_distance(a, b)
    assert torch.equal(fused.chamfer_distance(noncontiguous(a), noncontiguous(b)), expected)
    one = make((1, 25, 3), seed=37)
    assert_close(fused.chamfer_distance(a, one), fused.chamfer_distance(a, one.expand(3, 25, 3)))
    assert_close(fused.chamfer_distance(a[0], b[0]), ref.chamfer_distance(a[0], b[0]))  # unbatched [N, D]


def test_chamfer_bad_inputs():
    a, b = make((2, 4, 3)), make((2, 5, 3))
    with raises("fused.chamfer_distance: unknown reduction 'max'"):
        fused.chamfer_distance(a, b, reduction="max")
    with raises("fused.chamfer_distance: squared=True needs p=2"):
        fused.chamfer_distance(a, b, p=1.0)
    with raises("fused.chamfer_distance: lengths_a has a length 5 larger than the padded size 4"):
        fused.chamfer_distance(a, b, lengths_a=torch.tensor([5, 1]))
    with raises("fused.chamfer_distance: lengths_b must not be negative"):
        fused.chamfer_distance(a, b, lengths_b=torch.tensor([-1, 1]))
    with raises("fused.chamfer_distance: lengths_a must have the batch shape of a"):
        fused.chamfer_distance(a, b, lengths_a=torch.tensor([1, 2, 3]))
    with raises("fused.chamfer_distance: a and b must have the same last dim"):
        fused.chamfer_distance(a, make((2, 5, 2)))


# ---- ported from PyTorch3D's tests/test_knn.py ----
def test_knn_vs_python_cpu_square():
    for N, D, P1, P2, K in itertools.product([1, 4], [2, 3], [1, 10, 101], [10, 101], [1, 3, 10]):
        x, y = make((N, P1, D), seed=P1 * 7 + D), make((N, P2, D), seed=P2 * 11 + N)
        lengths1, lengths2 = torch.full((N,), P1), torch.full((N,), P2)
        dist, idx = fused.pairwise_topk(x, y, K, squared=True, lengths_a=lengths1, lengths_b=lengths2)
        rdist, ridx = ref.pairwise_topk(x, y, K, squared=True)
        assert torch.equal(idx, ridx), (N, D, P1, P2, K)
        assert_close(dist, rdist)


def test_knn_vs_python_cpu_ragged():
    lengths1, lengths2 = torch.tensor([10, 100, 10, 100]), torch.tensor([10, 10, 100, 100])
    x, y = make((4, 100, 3), seed=40), make((4, 100, 3), seed=41)
    for K in (1, 9, 10, 11, 101):
        if K <= 100:
            dist, idx = fused.pairwise_topk(x, y, K, squared=True, lengths_a=lengths1, lengths_b=lengths2)
        else:  # K past the padded size: every valid point, then missing slots
            dist, idx = fused.radius_neighbors(x, y, math.inf, K, lengths_a=lengths1, lengths_b=lengths2)
            dist = dist.square()
        rdist, ridx = ref.radius_neighbors(x, y, math.inf, K, lengths_a=lengths1, lengths_b=lengths2)
        assert torch.equal(idx, ridx), K
        assert_close(dist, rdist.square(), scale=2.0)
        assert (idx[0, :, 10:] == -1).all() and (idx[:, 10:][[0, 2]] == -1).all()


# ---- ported from PyTorch3D's tests/test_chamfer.py ----
def naive_chamfer(x, y, x_lengths=None, y_lengths=None, norm=2):
    """PyTorch3D's chamfer_distance_naive_pointclouds, loops and all: per-point nearest distances (squared L2 for
    norm 2, L1 for norm 1) of each direction, 0 for padded points."""
    N, P1, _ = x.shape
    P2 = y.shape[1]
    x_lengths = x_lengths if x_lengths is not None else torch.full((N,), P1)
    y_lengths = y_lengths if y_lengths is not None else torch.full((N,), P2)
    dist = torch.full((N, P1, P2), math.inf, dtype=x.dtype)
    for n in range(N):
        for i1 in range(x_lengths[n]):
            for i2 in range(y_lengths[n]):
                diff = x[n, i1] - y[n, i2]
                dist[n, i1, i2] = diff.square().sum() if norm == 2 else diff.abs().sum()
    x_dist, y_dist = dist.amin(2), dist.amin(1)
    x_dist = torch.where(torch.arange(P1) < x_lengths[:, None], x_dist, 0.0)
    y_dist = torch.where(torch.arange(P2) < y_lengths[:, None], y_dist, 0.0)
    return x_dist, y_dist


def init_pointclouds(N, P1, P2, allow_empty=True, seed=1):
    """PyTorch3D's init_pointclouds without normals: random lengths below P1, P2 (0 allowed), uniform points."""
    g = torch.Generator().manual_seed(seed)
    low = 0 if allow_empty else 1
    p1_lengths = torch.randint(low, P1, (N,), generator=g)
    p2_lengths = torch.randint(low, P2, (N,), generator=g)
    p1 = torch.rand((N, int(p1_lengths.max()), 3), generator=g).requires_grad_()
    p2 = torch.rand((N, int(p2_lengths.max()), 3), generator=g).requires_grad_()
    return p1, p2, p1_lengths, p2_lengths


def norm_kwargs(norm):
    return dict(p=2.0, squared=True) if norm == 2 else dict(p=1.0, squared=False)


def check_gradients(loss, leaves, expected, expected_leaves):
    """PyTorch3D's _check_gradients: both losses give the same gradients (their leaves may differ)."""
    for g, e in zip(torch.autograd.grad(loss, leaves), torch.autograd.grad(expected, expected_leaves)):
        assert_close(g, e, scale=4.0)


@pytest.mark.parametrize("norm", [1, 2])
def test_chamfer_point_batch_reduction_mean(norm):
    p1, p2, _, _ = init_pointclouds(7, 10, 18, seed=2)
    p11, p22 = p1.detach().clone().requires_grad_(), p2.detach().clone().requires_grad_()
    loss = fused.chamfer_distance(p11, p22, **norm_kwargs(norm))
    x_dist, y_dist = naive_chamfer(p1, p2, norm=norm)
    expected = (x_dist.sum(1) / p1.shape[1] + y_dist.sum(1) / p2.shape[1]).mean()
    assert_close(loss, expected)
    check_gradients(loss, (p11, p22), expected, (p1, p2))


@pytest.mark.parametrize("single", [False, True])
@pytest.mark.parametrize("norm", [1, 2])
def test_chamfer_vs_naive_pointcloud(norm, single):
    """Heterogeneous clouds (PyTorch3D's test_chamfer_vs_naive_pointcloud and
    test_single_directional_chamfer_vs_naive_pointcloud): padded rows get no gradient."""
    p1, p2, l1, l2 = init_pointclouds(3, 70, 70, allow_empty=False, seed=3)
    loss = fused.chamfer_distance(p1, p2, lengths_a=l1, lengths_b=l2, single_directional=single, **norm_kwargs(norm))
    x_dist, y_dist = naive_chamfer(p1, p2, l1, l2, norm)
    expected = x_dist.sum(1) / l1 + (0 if single else y_dist.sum(1) / l2)
    expected = expected.mean()
    assert_close(loss, expected)
    check_gradients(loss, (p1, p2), expected, (p1, p2))
    g1, g2 = torch.autograd.grad(fused.chamfer_distance(p1, p2, lengths_a=l1, lengths_b=l2), (p1, p2))
    for n in range(3):
        assert not g1[n, l1[n] :].any() and not g2[n, l2[n] :].any()


@pytest.mark.parametrize("single", [False, True])
def test_chamfer_point_reduction_sum(single):
    """PyTorch3D's test_chamfer_point_reduction_sum and its single-directional twin (batch reduction: mean)."""
    p1, p2, _, _ = init_pointclouds(7, 10, 18, seed=4)
    loss = fused.chamfer_distance(p1, p2, reduction="sum", single_directional=single)
    x_dist, y_dist = naive_chamfer(p1, p2)
    expected = (x_dist.sum(1) + (0 if single else y_dist.sum(1))).mean()
    assert_close(loss, expected)
    check_gradients(loss, (p1, p2), expected, (p1, p2))


def test_chamfer_joint_reduction():
    """PyTorch3D's test_chamfer_joint_reduction, for the point reductions we take (the batch reduction is the mean)."""
    p1, p2, _, _ = init_pointclouds(7, 10, 18, seed=5)
    x_dist, y_dist = naive_chamfer(p1, p2)
    assert_close(fused.chamfer_distance(p1, p2, reduction="sum"), (x_dist.sum(1) + y_dist.sum(1)).mean())
    assert_close(
        fused.chamfer_distance(p1, p2, reduction="mean"),
        (x_dist.sum(1) / p1.shape[1] + y_dist.sum(1) / p2.shape[1]).mean(),
    )
    with raises("fused.chamfer_distance: unknown reduction 'min'"):
        fused.chamfer_distance(p1, p2, reduction="min")


def test_empty_clouds():
    """PyTorch3D's test_empty_clouds: no division by zero; an empty cloud (and every point whose other cloud is
    empty) contributes 0. Clouds [0 points, 10 points at 0] against 40 points at 1: per cloud [0, 6]."""
    points1 = torch.zeros(2, 10, 3)
    points2 = torch.ones(2, 40, 3)
    loss = fused.chamfer_distance(points1, points2, lengths_a=torch.tensor([0, 10]))
    assert_close(loss, torch.tensor(3.0))  # the batch mean of [0, 6]
    assert fused.chamfer_distance(torch.zeros(0, 5, 3), torch.zeros(0, 4, 3)).isnan()  # the mean of no clouds
    loss = fused.chamfer_distance(torch.zeros(2, 0, 3), torch.ones(2, 4, 3))  # no points at all in a
    assert loss.item() == 0.0


def test_incorrect_inputs():
    """PyTorch3D's test_incorrect_inputs and test_invalid_norm, as our errors."""
    p1, p2, _, _ = init_pointclouds(7, 10, 18, seed=6)
    with raises("fused.chamfer_distance: lengths_a must have the batch shape of a"):
        fused.chamfer_distance(p1, p2, lengths_a=torch.tensor([1, 2, 3]))
    with raises(r"fused::chamfer_distance\(\) Expected a value of type 'Tensor' for argument 'a'"):
        fused.chamfer_distance([1, 1, 1], p2)
    with raises("fused.chamfer_distance: p must be in"):
        fused.chamfer_distance(p1, p2, p=-1.0, squared=False)


# ---- property test: random padded batches, duplicates and ties, against the references ----
if given is not None:

    @settings(max_examples=60, deadline=None)
    @given(
        n=st.integers(0, 40),
        m=st.integers(0, 40),
        d=st.sampled_from([1, 2, 3, 33]),
        p=st.sampled_from([2.0, 1.0, math.inf]),
        data=st.data(),
    )
    def test_geometry_hypothesis_cpu(n, m, d, p, data):
        """Points on a small integer grid (duplicates and exact ties everywhere), random lengths (0 and full
        included): radius_neighbors equal to the reference, indices included, on the direct path (exact integer
        sums, correctly rounded roots); on the matmul path within a rounding; chamfer within rounding."""
        gen = torch.Generator().manual_seed(n * 7919 + m * 104729 + d)
        a = torch.randint(-2, 3, (3, n, d), generator=gen).float()
        b = torch.randint(-2, 3, (3, m, d), generator=gen).float()
        la = torch.tensor(data.draw(st.lists(st.integers(0, n), min_size=3, max_size=3)))
        lb = torch.tensor(data.draw(st.lists(st.integers(0, m), min_size=3, max_size=3)))
        radius = data.draw(st.sampled_from([0.0, 1.0, 2.5, math.inf]))
        k = data.draw(st.integers(1, m + 3))
        v, i = fused.radius_neighbors(a, b, radius, k, lengths_a=la, lengths_b=lb, p=p)
        rv, ri = ref.radius_neighbors(a.double(), b.double(), radius, k, lengths_a=la, lengths_b=lb, p=p)
        if p == 2 and d >= 32:  # the matmul path: sqrt of an exact sum, within a rounding of the reference
            torch.testing.assert_close(v.double(), rv, rtol=1e-6, atol=0)
        else:  # integer sums (and their correctly rounded roots): exact
            assert torch.equal(i, ri)
            assert torch.equal(v, rv.float())
        if p == 2:
            loss = fused.chamfer_distance(a, b, lengths_a=la, lengths_b=lb)
            expected = ref.chamfer_distance(a.double(), b.double(), la, lb)
            torch.testing.assert_close(loss.double(), expected, rtol=1e-6, atol=1e-6, equal_nan=True)


# ---- torch.compile (opcheck: tests/test_op_coverage.py) ----
def test_compile():
    a, b = make((2, 6, 3), seed=52), make((2, 8, 3), seed=53)
    la, lb = torch.tensor([6, 2]), torch.tensor([1, 8])
    check_compile(lambda x, y, u, w: fused.radius_neighbors(x, y, 1.5, 4, lengths_a=u, lengths_b=w), a, b, la, lb)
    check_compile(
        lambda x, y, u, w: fused.chamfer_distance(x, y, lengths_a=u, lengths_b=w, return_indices=True), a, b, la, lb
    )

    check_compile_grads(
        lambda x, y: (
            fused.chamfer_distance(x, y, lengths_a=la, lengths_b=lb) + fused.radius_neighbors(x, y, 9.0, 3)[0].sum()
        ),
        a,
        b,
    )


def test_public_ops_exist():
    for name in ("radius_neighbors", "chamfer_distance"):
        assert hasattr(torch.ops.fused, name) and name in fused.__all__


# ---- Triton launchers (under TRITON_INTERPRET=1 on CPU where there is no GPU) ----
TRITON_DEVICE = "cuda" if HAS_CUDA else "cpu"


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
@pytest.mark.parametrize("D", [3, 40])
def test_triton_radius_neighbors(dtype, D):
    from fused.distance import triton_kernels as tk

    a, la = padded(20, [20, 1, 0], D, dtype, TRITON_DEVICE, seed=60)
    b, lb = padded(30, [30, 9, 12], D, dtype, TRITON_DEVICE, seed=61)
    radius = 1.2 * math.sqrt(D)
    for width in (4, 35):
        v, i = tk.radius_neighbors(a, b, radius, width, la, lb)
        rv, ri = ref.radius_neighbors(
            clean(a, la).cpu(), clean(b, lb).cpu(), radius, width, lengths_a=la.cpu(), lengths_b=lb.cpu()
        )
        assert_close(v.cpu(), rv, scale=2.0)
        if dtype == torch.float64:
            assert torch.equal(i.cpu(), ri)
        assert torch.equal(v.cpu() == math.inf, i.cpu() == -1)
    for radius in (0.0, math.inf):
        v, i = tk.radius_neighbors(a, b, radius, 6, la, lb)
        rv, ri = ref.radius_neighbors(
            clean(a, la).cpu(), clean(b, lb).cpu(), radius, 6, lengths_a=la.cpu(), lengths_b=lb.cpu()
        )
        assert torch.equal(i.cpu(), ri)


@requires_triton
def test_triton_select_by_chunks():
    """Many neighbours per row: the row-chunk path (distances + stable sort), with lengths and the radius."""
    from fused.distance import triton_kernels as tk

    a, la = padded(10, [10, 3], 3, torch.float64, TRITON_DEVICE, seed=62)
    b, lb = padded(12, [12, 5], 3, torch.float64, TRITON_DEVICE, seed=63)
    old = tk.MAX_TOPK_REGISTERS
    try:
        tk.MAX_TOPK_REGISTERS = 2
        v, i = tk.radius_neighbors(a, b, 3.0, 14, la, lb)
        rv, ri = ref.radius_neighbors(
            clean(a, la).cpu(), clean(b, lb).cpu(), 3.0, 14, lengths_a=la.cpu(), lengths_b=lb.cpu()
        )
        assert torch.equal(i.cpu(), ri)
        assert_close(v.cpu(), rv)
        v, i = tk.pairwise_topk(a, b, 6, 2.0, False, True, la, lb)
        rv, ri = ref.pairwise_topk(
            clean(a, la).cpu(), clean(b, lb).cpu(), 6, largest=True, lengths_a=la.cpu(), lengths_b=lb.cpu()
        )
        assert torch.equal(i.cpu(), ri)
        assert_close(v.cpu(), rv)
    finally:
        tk.MAX_TOPK_REGISTERS = old


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("p", [2.0, math.inf])
def test_radius_neighbors_gradient_without_points_in_b(dtype, p):
    """No rows in b: no neighbours, and zero gradients (16-bit p = inf recomputes the pairs in float32: nothing to
    gather), from the op and from each backward kernel, Triton's included."""
    a = make((2, 5, 3), dtype, requires_grad=True, seed=72)
    b = make((2, 0, 3), dtype, requires_grad=True, seed=73)
    v, i = fused.radius_neighbors(a, b, 1.0, 4, p=p)
    assert (i == -1).all()
    v.float().sum().backward()
    assert a.grad.shape == a.shape and (a.grad == 0).all() and b.grad.shape == b.shape
    args = [t.detach() for t in (torch.ones_like(v), a, b, v, i)]
    kernels = [(torch.ops.fused.pairwise_topk_backward, "cpu")]
    if HAS_TRITON:
        from fused.distance import triton_kernels as tk

        kernels.append((tk.pairwise_topk_backward, TRITON_DEVICE))
    for kernel, device in kernels:
        grad_a, grad_b = kernel(*(t.to(device) for t in args), p, False)
        assert (grad_a == 0).all() and grad_b.shape == b.shape, kernel
