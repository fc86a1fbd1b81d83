"""Parity, accuracy and edge cases of fused.pairwise_distances and fused.pairwise_topk (the definition of done in
CONTRIBUTING.md, plus cases from torch.cdist's reported issues), padded batches (lengths_a / lengths_b) included.
The point-cloud ops built on them (radius_neighbors, chamfer_distance) are in test_geometry.py."""

import math
import os
import subprocess
import sys

import pytest
import torch

import fused
from fused.distance import reference as ref
from fused.distance.ops import MATMUL_MIN_D
from tests.harness import (
    ALL_DTYPES,
    FLOAT_DTYPES,
    TRITON_DEVICE,
    assert_accuracy,
    assert_close,
    backend,
    check_compile,
    check_compile_grads,
    compile_for_sm90,
    device_backends,
    given,
    make,
    noncontiguous,
    raises,
    requires_cuda,
    requires_triton,
    settings,
    st,
)

PS = [0.0, 1.0, 2.0, 3.0, 0.5, math.inf]
# D=3: the direct path for every p; D=131: the matmul path for p=2 (direct for the other p).
DIMS = [3, 131]


def eager(a, b, p=2.0, squared=False):
    """What a user would write in the same dtype: torch.cdist where it takes the dtype, else the broadcast formula."""
    if a.dtype in (torch.float32, torch.float64) and not squared:
        return torch.cdist(a, b, p)
    diff = a.unsqueeze(-2) - b.unsqueeze(-3)
    if squared:
        return diff.square().sum(-1)
    return torch.linalg.vector_norm(diff, ord=p, dim=-1)


def ref64(a, b, p=2.0, squared=False):
    return ref.pairwise_distances(a.double(), b.double(), p, squared)


# ---- parity with the reference ----
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("D", DIMS)
@pytest.mark.parametrize("p", PS)
def test_distances_parity(dev, dtype, D, p):
    a = make((3, 5, D), dtype, dev, seed=1)
    b = make((3, 7, D), dtype, dev, seed=2)
    out = fused.pairwise_distances(a, b, p)
    expected = ref.pairwise_distances(a, b, p)
    assert out.shape == (3, 5, 7) and out.dtype == dtype
    # Half outputs may round the other way than the reference's; p = 0 counts are exact.
    assert_close(out, expected, scale=2.0 if dtype in (torch.float16, torch.bfloat16) else 1.0)
    if p == 0:
        assert torch.equal(out, expected)


@pytest.mark.parametrize("D", DIMS)
@pytest.mark.parametrize("p", PS)
def test_distances_grad_parity(dev, D, p):
    a = make((2, 5, D), torch.float64, dev, seed=3, requires_grad=True)
    b = make((2, 6, D), torch.float64, dev, seed=4, requires_grad=True)
    g = make((2, 5, 6), torch.float64, dev, seed=5)
    ours = torch.autograd.grad(fused.pairwise_distances(a, b, p), (a, b), g)
    theirs = torch.autograd.grad(ref.pairwise_distances(a, b, p), (a, b), g)
    for o, t in zip(ours, theirs):
        assert_close(o, t, scale=10.0)


@pytest.mark.parametrize("D", [3, 64])
def test_squared(D):
    a, b = make((40, D), seed=6), make((50, D), seed=7)
    out = fused.pairwise_distances(a, b, squared=True)
    assert_close(out, ref.pairwise_distances(a, b, squared=True), scale=4.0)
    ag, bg = a.double().requires_grad_(), b.double().requires_grad_()
    assert torch.autograd.gradcheck(lambda x, y: fused.pairwise_distances(x, y, squared=True), (ag[:5], bg[:6]))


def test_large_shapes():
    for D in (3, 64):
        a, b = make((1, 300, D), seed=8), make((1, 517, D), seed=9)
        assert_close(fused.pairwise_distances(a, b), ref.pairwise_distances(a, b), scale=2.0)
        assert_close(fused.pairwise_distances(a, b, 1.0), ref.pairwise_distances(a, b, 1.0), scale=2.0)


def test_noncontiguous_and_expanded_inputs():
    a, b = make((4, 9, 5), seed=10), make((4, 11, 5), seed=11)
    expected = ref.pairwise_distances(a, b)
    assert_close(fused.pairwise_distances(noncontiguous(a), noncontiguous(b)), expected)
    assert_close(fused.pairwise_distances(a.transpose(-1, -2).contiguous().transpose(-1, -2), b), expected)
    one = make((1, 11, 5), seed=12)
    assert_close(fused.pairwise_distances(a, one.expand(4, 11, 5)), ref.pairwise_distances(a, one))


def test_broadcast_batch_and_gradient_shapes():
    a = make((2, 1, 5, 4), torch.float64, seed=13, requires_grad=True)
    b = make((3, 7, 4), torch.float64, seed=14, requires_grad=True)
    out = fused.pairwise_distances(a, b)
    assert out.shape == (2, 3, 5, 7)
    g = make(out.shape, torch.float64, seed=15)
    ga, gb = torch.autograd.grad(out, (a, b), g)
    ra, rb = torch.autograd.grad(ref.pairwise_distances(a, b), (a, b), g)
    assert ga.shape == a.shape and gb.shape == b.shape
    assert_close(ga, ra)
    assert_close(gb, rb)
    # [N, D] x [B, M, D] broadcasts too.
    a2 = make((5, 4), torch.float64, seed=16)
    assert_close(fused.pairwise_distances(a2, b), ref.pairwise_distances(a2, b))


@pytest.mark.parametrize(
    "shape_a,shape_b", [((0, 3), (4, 3)), ((5, 3), (0, 3)), ((5, 0), (4, 0)), ((0, 5, 3), (0, 4, 3))]
)
def test_empty_inputs(shape_a, shape_b):
    a = torch.zeros(shape_a, requires_grad=True)
    b = torch.zeros(shape_b, requires_grad=True)
    out = fused.pairwise_distances(a, b)
    assert out.shape == ref.pairwise_distances(a, b).shape
    assert torch.equal(out, torch.zeros_like(out))  # D = 0: every distance is 0
    out.sum().backward()
    assert a.grad.shape == a.shape and b.grad.shape == b.shape
    assert not a.grad.any() and not b.grad.any()
    if shape_b[-2] > 0:
        v, i = fused.pairwise_topk(a, b, 1)
        assert v.shape == i.shape == (*shape_a[:-1], 1)


# ---- accuracy against float64 ----
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("D", [3, 64])
@pytest.mark.parametrize("p", [1.0, 2.0, math.inf])
def test_accuracy(dtype, D, p):
    a, b = make((64, D), dtype, seed=17), make((80, D), dtype, seed=18)
    assert_accuracy(fused.pairwise_distances(a, b, p), eager(a, b, p), ref64(a, b, p))


@pytest.mark.parametrize("D", [3, 64])
def test_accuracy_grad(D):
    a = make((40, D), seed=19, requires_grad=True)
    b = make((50, D), seed=20, requires_grad=True)
    a64, b64 = a.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    g = make((40, 50), seed=21)
    ours = torch.autograd.grad(fused.pairwise_distances(a, b), (a, b), g)
    theirs = torch.autograd.grad(torch.cdist(a, b), (a, b), g)
    exact = torch.autograd.grad(ref.pairwise_distances(a64, b64), (a64, b64), g.double())
    for o, t, e in zip(ours, theirs, exact):
        assert_accuracy(o, t, e)


def max_norm_grads64(a, b, g):
    """Float64 gradients of the max-norm distances, torch.cdist's way: grad * sign(diff) on every coordinate whose
    |diff| is the maximum (each tie gets it whole)."""
    diff = a.double().unsqueeze(-2) - b.double().unsqueeze(-3)  # [*, N, M, D]
    w = g.double().unsqueeze(-1) * diff.sign() * (diff.abs() == diff.abs().amax(-1, keepdim=True))
    return w.sum(-2).sum_to_size(a.shape), (-w.sum(-3)).sum_to_size(b.shape)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_max_norm_gradients_in_16_bit(dev, dtype):
    """The max-norm gradient goes to the coordinate of the largest |a - b|. The saved 16-bit distances are rounded,
    so comparing |a - b| with them missed that coordinate in most pairs (gradient 0, in the CPU, CUDA and Triton
    kernels alike): the backward recomputes the distances in float32 (found by the CUDA emulation's tests)."""
    a = make((2, 30, 5), dtype, dev, seed=70, requires_grad=True)
    b = make((40, 5), dtype, dev, seed=71, requires_grad=True)
    g = make((2, 30, 40), dtype, dev, seed=72)
    ga, gb = torch.autograd.grad(fused.pairwise_distances(a, b, math.inf), (a, b), g)
    for ours, exact in zip((ga, gb), max_norm_grads64(a, b, g)):
        assert_close(ours.cpu(), exact.cpu(), dtype, scale=2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dev", device_backends("pairwise_topk"), indirect=True)
def test_max_norm_topk_gradients_in_16_bit(dev, dtype):
    """As test_max_norm_gradients_in_16_bit, through pairwise_topk."""
    a = make((2, 30, 5), dtype, dev, seed=70, requires_grad=True)
    b = make((40, 5), dtype, dev, seed=71, requires_grad=True)
    v, i = fused.pairwise_topk(a, b, 6, math.inf)
    gv = make(v.shape, dtype, dev, seed=73)
    ta, tb = torch.autograd.grad(v, (a, b), gv)
    selected = torch.zeros(2, 30, 40, dtype=dtype, device=dev).scatter(-1, i, gv)  # the topk's grad on N x M
    for ours, exact in zip((ta, tb), max_norm_grads64(a, b, selected)):
        assert_close(ours.cpu(), exact.cpu(), dtype, scale=2)


# ---- cases from torch.cdist's issues ----
def test_issue_42479_exact_difference():
    # torch.cdist's matmul path loses this difference (pytorch issue 42479); ours is exact.
    a = torch.full((30, 1), 512695.0)
    b = torch.full((40, 1), 512804.0)
    assert torch.equal(fused.pairwise_distances(a, b), torch.full((30, 40), 109.0))
    assert torch.equal(fused.pairwise_topk(a, b, 3)[0], torch.full((30, 3), 109.0))


@pytest.mark.parametrize("D", [3, 64])
def test_points_far_from_origin(D):
    a = (make((50, D), torch.float64, seed=22) + 1e4).float()
    b = (make((60, D), torch.float64, seed=23) + 1e4).float()
    exact = ref64(a, b)  # of the float32 inputs
    ours = fused.pairwise_distances(a, b)
    err = ((ours.double() - exact).abs() / exact).max().item()
    assert err < 1e-6, err  # cdist's mm path: ~1e-2 here
    assert_accuracy(ours, torch.cdist(a, b), exact)


def test_self_distance_is_exactly_zero_at_large_d():
    a = make((100, 128), seed=24)
    d = fused.pairwise_distances(a, a)
    assert torch.equal(d.diagonal(), torch.zeros(100))
    assert (d.fill_diagonal_(1.0) > 0).all()
    assert torch.equal(fused.pairwise_topk(a, a, 1)[0], torch.zeros(100, 1))


@pytest.mark.parametrize("D", [3, 128])
def test_near_duplicates_gradient_has_unit_norm(D):
    a = make((20, D), seed=25, requires_grad=True)
    direction = torch.nn.functional.normalize(make((20, D), seed=26), dim=-1)
    b = (a.detach() + 1e-3 * direction).requires_grad_()
    d = fused.pairwise_distances(a, b)
    torch.testing.assert_close(d.diagonal(), torch.full((20,), 1e-3), rtol=1e-3, atol=0)
    (ga,) = torch.autograd.grad(d.diagonal().sum(), a)
    torch.testing.assert_close(ga.norm(dim=-1), torch.ones(20), rtol=1e-3, atol=0)


def test_zero_distance_gradient_is_zero_not_nan():
    a = make((6, 3), torch.float64, seed=27, requires_grad=True)
    for p in (2.0, 1.0, 3.0, 0.5):
        d = fused.pairwise_distances(a, a, p)
        (g,) = torch.autograd.grad(d.diagonal().sum(), a)
        assert torch.equal(g, torch.zeros_like(g)), p


def test_half_inputs_whose_squares_overflow_fp16():
    a = make((30, 8), torch.float16, low=200, high=300, seed=28)
    b = make((40, 8), torch.float16, low=-300, high=-200, seed=29)
    out = fused.pairwise_distances(a, b)
    assert torch.isfinite(out).all()
    assert not torch.isfinite(((a[:, None] - b[None]) ** 2).sum(-1).sqrt()).any()  # the fp16 formula overflows
    torch.testing.assert_close(out.double(), ref64(a, b), rtol=1e-3, atol=0)


@pytest.mark.parametrize("p", [1.0, 2.0, 3.0, math.inf, 0.0])
def test_nan_and_inf_propagate(p):
    a, b = make((5, 3), seed=30), make((6, 3), seed=31)
    a[1, 0], b[2, 1], a[3, 2] = math.nan, math.inf, -math.inf
    for D in (3, 40):  # D = 40: the matmul path for p = 2
        aa = torch.cat([a, make((5, D - 3), seed=32)], 1)
        bb = torch.cat([b, make((6, D - 3), seed=33)], 1)
        out = fused.pairwise_distances(aa, bb, p)
        expected = ref.pairwise_distances(aa, bb, p)
        assert torch.equal(out.isnan(), expected.isnan())
        assert torch.equal(out.isinf(), expected.isinf())
        assert_close(out, expected)


def test_gradcheck():
    a = make((4, 3), torch.float64, seed=34, requires_grad=True)
    b = make((5, 3), torch.float64, seed=35, requires_grad=True)
    for p in (1.0, 2.0, 3.0, 0.7, math.inf):
        assert torch.autograd.gradcheck(lambda x, y: fused.pairwise_distances(x, y, p), (a, b)), p
    a40 = make((3, 40), torch.float64, seed=36, requires_grad=True)
    b40 = make((4, 40), torch.float64, seed=37, requires_grad=True)
    assert torch.autograd.gradcheck(fused.pairwise_distances, (a40, b40))
    assert torch.autograd.gradcheck(lambda x, y: fused.pairwise_topk(x, y, 3)[0], (a, b))
    assert torch.autograd.gradcheck(lambda x, y: fused.pairwise_topk(x, y, 2, p=1.0, largest=True)[0], (a, b))


def test_backward_is_deterministic_across_thread_counts():
    a = make((300, 5), seed=38, requires_grad=True)
    b = make((200, 5), seed=39, requires_grad=True)
    g = make((300, 200), seed=40)
    grads = []
    old = torch.get_num_threads()
    try:
        for threads in (1, 2, 1):
            torch.set_num_threads(threads)
            grads.append(torch.autograd.grad(fused.pairwise_distances(a, b), (a, b), g))
    finally:
        torch.set_num_threads(old)
    for other in grads[1:]:
        assert all(torch.equal(x, y) for x, y in zip(grads[0], other))


# ---- pairwise_topk ----
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("D", DIMS)
@pytest.mark.parametrize("p,largest", [(2.0, False), (2.0, True), (1.0, False), (math.inf, False), (0.5, True)])
def test_topk_parity(dev, dtype, D, p, largest):
    a = make((2, 9, D), dtype, dev, seed=41)
    b = make((2, 37, D), dtype, dev, seed=42)
    v, i = fused.pairwise_topk(a, b, 5, p, largest=largest)
    assert i.dtype == torch.int64 and v.shape == i.shape == (2, 9, 5)
    rv, ri = ref.pairwise_topk(a, b, 5, p, largest=largest)
    assert_close(v, rv, scale=2.0)
    if dev == "cpu" and p == 2 and D >= MATMUL_MIN_D:
        # The CPU's GEMM path re-ranks exactly: a float64 search's indices, its values rounded once.
        rv64, ri64 = ref.pairwise_topk(a.double(), b.double(), 5, p, largest=largest)
        assert torch.equal(i, ri64)
        if dtype == torch.float32:
            assert torch.equal(v, rv64.to(dtype))
        else:
            assert_close(v, rv64.to(dtype))
        return
    # Our values are the pairwise_distances at our indices (bitwise on CPU: the same tile kernels), sorted.
    full = fused.pairwise_distances(a, b, p)
    if dev == "cpu":
        assert torch.equal(v, full.gather(-1, i))
    else:
        assert_close(v, full.gather(-1, i))
    if dtype == torch.float64:
        assert torch.equal(i, ri)


def test_topk_ties_go_to_the_lower_index_and_values_are_sorted():
    a = torch.tensor([[0.0, 0.0], [1.0, 1.0]])
    b = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [0.0, 0.0], [0.0, -1.0], [2.0, 2.0]])
    v, i = fused.pairwise_topk(a, b, 4)
    assert i[0].tolist() == [3, 0, 1, 2]
    assert v[0].tolist() == [0.0, 1.0, 1.0, 1.0]
    assert i[1].tolist() == [0, 1, 3, 5]
    v, i = fused.pairwise_topk(a, b, 2, largest=True)
    assert i[0].tolist() == [5, 0] and i[1].tolist() == [2, 4]
    grid = torch.randint(0, 3, (50, 2)).float()
    pts = torch.randint(0, 3, (70, 2)).float()
    v, i = fused.pairwise_topk(grid, pts, 10)
    rv, ri = ref.pairwise_topk(grid, pts, 10)
    assert torch.equal(v, rv) and torch.equal(i, ri)
    assert (v[:, 1:] >= v[:, :-1]).all()


if given is not None:

    @settings(max_examples=100, deadline=None)
    @given(
        batch_a=st.sampled_from([(), (1,), (2,), (3, 1)]),
        batch_b=st.sampled_from([(), (1,), (2,), (1, 2)]),
        n=st.integers(0, 70),
        m=st.integers(1, 70),
        d=st.sampled_from([1, 2, 3, 7, 31, 32, 33, 64]),
        p=st.sampled_from(PS),
        largest=st.booleans(),
        data=st.data(),
    )
    def test_distances_and_topk_hypothesis_cpu(batch_a, batch_b, n, m, d, p, largest, data):
        """Random broadcast shapes on both paths (D across the matmul threshold), points on a small integer grid
        so that duplicates and ties are common: distances against float64, topk equal to the stable-sort
        reference (indices included where the distances are exact: for every p but 0.5, whose sums of square roots
        round; on the GEMM path the selection re-ranks exactly), its values the distances at its indices."""
        k = data.draw(st.integers(0, m))
        gen = torch.Generator().manual_seed(n * 7919 + m * 104729 + d)
        a = torch.randint(-2, 3, (*batch_a, n, d), generator=gen).float()
        b = torch.randint(-2, 3, (*batch_b, m, d), generator=gen).float()
        dist = fused.pairwise_distances(a, b, p)
        want = ref64(a, b, p)
        assert dist.shape == want.shape
        exact = p != 0.5
        # a few fp32 roundings; the 1/p root doubles the sum's relative error at p = 0.5
        torch.testing.assert_close(dist.double(), want, rtol=1e-6 if p == 0.5 else 4e-7, atol=0)
        v, i = fused.pairwise_topk(a, b, k, p, largest=largest)
        rv, ri = ref.pairwise_topk(a.double(), b.double(), k, p, largest=largest)
        assert torch.equal(v, dist.gather(-1, i))
        if exact:
            assert torch.equal(i, ri), (p, k, largest)
        else:
            torch.testing.assert_close(v.double(), rv, rtol=1e-6, atol=0)


def gemm_adversarial(dtype, seed):
    """Two batches of points at D = 96 against which the GEMM's candidates are least reliable: b in two clusters
    1e4 apart (its mean, where the points are centered, lies between them: |x|^2 + |y|^2 - 2 x.y cancels to
    about 1e-8 relative), near-ties (copies of a row of b moved by 2^-20 relative, below float32's resolution of
    the formula), exact duplicates, and rows of a on top of rows of b."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(2, 150, 96, generator=g, dtype=torch.float64)
    b = torch.randn(2, 600, 96, generator=g, dtype=torch.float64)
    shift = torch.zeros(96, dtype=torch.float64)
    shift[0] = 1e4
    b[0, :300] += shift
    b[0, 300:] -= shift
    a[0, :75] += shift
    a[0, 75:] -= shift
    b[1, 1:40] = b[1, 0] * (1 + 2.0**-20 * torch.randn(39, 1, generator=g, dtype=torch.float64))
    b[1, 40:50] = b[1, 0]
    a[1, :20] = b[1, 0]
    a[0, 100:110] = b[0, 300:310]
    return a.to(dtype), b.to(dtype)


@pytest.mark.usefixtures("knn_filter")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("squared,largest", [(False, False), (True, False), (False, True)])
def test_topk_gemm_path_is_exact(dtype, squared, largest):
    """p = 2 at large D on the CPU: GEMM candidates, then an exact re-rank: the indices of a float64 search of
    the same inputs (ties to the lower index), its values rounded once to float32; padded batches too (their
    padded rows are NaN, never read)."""
    a, b = gemm_adversarial(dtype, seed=91)
    la, lb = torch.tensor([150, 37]), torch.tensor([600, 45])
    a_nan, b_nan = a.clone(), b.clone()
    a_nan[1, 37:], b_nan[1, 45:] = math.nan, math.nan
    for k, lengths in ((12, (None, None)), (45, (la, lb))):
        x, y = (a, b) if lengths[0] is None else (a_nan, b_nan)
        v, i = fused.pairwise_topk(
            x, y, k, squared=squared, largest=largest, lengths_a=lengths[0], lengths_b=lengths[1]
        )
        rv, ri = ref.pairwise_topk(
            a.double(), b.double(), k, squared=squared, largest=largest, lengths_a=lengths[0], lengths_b=lengths[1]
        )
        assert torch.equal(i, ri)
        if dtype == torch.float32:
            assert torch.equal(v, rv.to(dtype))
        else:  # float64: another summation order; bf16: double -> bf16 may round through float
            torch.testing.assert_close(v, rv.to(dtype), rtol=1e-14 if dtype == torch.float64 else 2**-7, atol=0)


@pytest.mark.usefixtures("knn_filter")
@pytest.mark.parametrize("largest", [False, True])
def test_topk_gemm_path_splits_columns_across_threads(largest):
    """Few rows against many columns: the GEMM path splits the columns among the threads, each split keeping its
    own candidates; the merged answer is the float64 search's, for 1, 2 and 3 threads, with near-ties and exact
    ties falling in different splits, and padded batches."""
    g = torch.Generator().manual_seed(96)
    b = torch.randn(2, 4700, 40, generator=g, dtype=torch.float64)
    a = torch.randn(2, 7, 40, generator=g, dtype=torch.float64)
    b[0, 4600] = b[0, 3]  # an exact tie across splits
    b[0, 2500] = b[0, 3] * (1 + 2.0**-30)  # and a near-tie
    a[0, 0] = b[0, 3]
    a[1, 1] = b[1, 4000] + 1e-3
    a, b = a.float(), b.float()
    la, lb = torch.tensor([7, 3]), torch.tensor([4700, 4100])
    expect = [
        ref.pairwise_topk(a.double(), b.double(), 20, largest=largest),
        ref.pairwise_topk(a.double(), b.double(), 20, largest=largest, lengths_a=la, lengths_b=lb),
    ]
    old = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            for lengths, (rv, ri) in zip(((None, None), (la, lb)), expect):
                v, i = fused.pairwise_topk(a, b, 20, largest=largest, lengths_a=lengths[0], lengths_b=lengths[1])
                assert torch.equal(i, ri), threads
                assert torch.equal(v, rv.float()), threads
    finally:
        torch.set_num_threads(old)


@pytest.mark.usefixtures("knn_filter")
def test_topk_gemm_path_non_finite_rows():
    """inf and NaN in rows of a and b at D = 64 (no GEMM bound holds for them): ranked as torch.topk ranks them."""
    a, b = make((6, 64), torch.float64, seed=92), make((40, 64), torch.float64, seed=93)
    a[1, 3], a[2, 0], b[5, 7], b[9, 1], b[11, 2] = math.inf, math.nan, math.inf, math.nan, 1e200
    for largest in (False, True):
        v, i = fused.pairwise_topk(a.float(), b.float(), 40, largest=largest)
        rv, ri = ref.pairwise_topk(a.float().double(), b.float().double(), 40, largest=largest)
        assert torch.equal(i, ri)
        torch.testing.assert_close(v, rv.float(), rtol=0, atol=0, equal_nan=True)


@pytest.mark.usefixtures("knn_filter")
@pytest.mark.parametrize("D", [64, 768])
def test_topk_gemm_filter_bound_holds_where_code_rounding_is_correlated(D):
    """A row x of a and its exact copy in b: one element 1 (the row's largest: code L, the int8 GEMM's levels) and
    the others (c + 0.499) / L, 0.499 of a code step above their codes c. A column z of the same codes, 1 and
    c / L, comes first. Both columns have x's codes, so the codes' dot ranks z (d^2 = (D - 1) (0.499 / L)^2) far
    nearer than the copy (d^2 = 0) once the norms are added: the copy is kept only by the codes' bound, which
    covers it with 2.2% to spare at D = 64 and 0.4% at D = 768 (3% less slack drops it). The answer is the
    float64 search's; the 127 wide rows keep the points uncentered."""
    levels = fused._C.int8_gemm_levels() or 127
    c = round(0.79 * levels)
    g = torch.Generator().manual_seed(99)
    a = torch.randn(3, D, generator=g)
    a[0] = (c + 0.499) / levels
    a[0, 0] = 1.0
    z = torch.full((1, D), c / levels)
    z[0, 0] = 1.0
    b = torch.cat([z, 100 * torch.randn(127, D, generator=g), a[:1]])
    for k in (1, 2):
        v, i = fused.pairwise_topk(a, b, k)
        rv, ri = ref.pairwise_topk(a.double(), b.double(), k)
        assert torch.equal(i, ri) and torch.equal(v, rv.float()), k
    assert i[0].tolist() == [128, 0]


@pytest.mark.usefixtures("knn_filter")
@pytest.mark.parametrize("flush_denormal", [False, True])
def test_topk_gemm_path_exact_at_every_scale(flush_denormal):
    """Rows at scales from 1e-38 (subnormal elements and products) to 1e18, mixed within b and within a, with
    subnormals flushed to zero (DAZ / FTZ) or not: the float64 search's indices, for nearest and farthest."""
    g = torch.Generator().manual_seed(103)
    scales = torch.tensor([1e-38, 1e-30, 1e-20, 1e-3, 1.0, 1e10, 1e18], dtype=torch.float64)
    b = torch.randn(350, 48, generator=g, dtype=torch.float64) * scales[torch.arange(350) % 7, None]
    a = torch.randn(21, 48, generator=g, dtype=torch.float64) * scales[torch.arange(21) % 7, None]
    a[::7] = b[:21:7] * (1 + 1e-3)  # queries next to the tiniest rows of b
    a, b = a.float(), b.float()
    try:
        assert torch.set_flush_denormal(flush_denormal) or not flush_denormal  # x86 supports it
        for largest in (False, True):
            v, i = fused.pairwise_topk(a, b, 9, largest=largest)
            rv, ri = ref.pairwise_topk(a.double(), b.double(), 9, largest=largest)
            assert torch.equal(i, ri), largest
    finally:
        torch.set_flush_denormal(False)


def test_int8_filter_with_7_bit_codes():
    """Where torch's int8 GEMM pairs its products in saturating int16 (oneDNN without int8 dot products; forced
    here with ONEDNN_MAX_CPU_ISA=AVX2), 8-bit codes would overflow it: the probe finds 7-bit codes exact, and the
    int8 filter's tests pass with them."""
    if fused._C.int8_gemm_levels() == 0:
        pytest.skip("torch's int8 GEMM is not exact on this CPU")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX2", PYTHONPATH=root)
    levels = "import fused; print(fused._C.int8_gemm_levels())"
    probe = subprocess.run([sys.executable, "-c", levels], capture_output=True, text=True, env=env, timeout=300)
    assert probe.stdout.split() == ["63"], probe.stderr
    tests = "int8_filter and (gemm_path_is_exact or correlated or every_scale or splits or non_finite)"
    pytest_args = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", tests, __file__]
    run = subprocess.run([sys.executable, *pytest_args], capture_output=True, text=True, env=env, timeout=600, cwd=root)
    assert run.returncode == 0, run.stdout[-3000:]
    assert " passed" in run.stdout and "failed" not in run.stdout, run.stdout[-3000:]


def test_topk_takes_the_gemm_path_by_d_alone():
    """The path follows (p, D): at D >= MATMUL_MIN_D, p = 2, pairwise_topk runs a GEMM (at::mm, or at::_int_mm
    for the int8 filter) whatever N and M (one row against three, or 300 against 1000), and never below that D or
    for another p."""

    def runs_mm(n, m, d, p):
        a, b = make((n, d), seed=94), make((m, d), seed=95)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            fused.pairwise_topk(a, b, 1, p)
        return any(e.key in ("aten::mm", "aten::_int_mm") for e in prof.key_averages())

    for n, m in ((1, 3), (300, 1000)):
        assert runs_mm(n, m, MATMUL_MIN_D, 2.0) and runs_mm(n, m, 200, 2.0)
        assert not runs_mm(n, m, MATMUL_MIN_D - 1, 2.0) and not runs_mm(n, m, 200, 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_topk_nearest_only(dtype):
    """k = 1 (chamfer_distance's search; on the CPU a branch-free running minimum per lane): exact ties across
    lanes go to the lowest column, 101 columns end in a tail, and rows whose every distance is inf or NaN are
    ranked as torch.topk ranks them; with padded batches too."""
    g = torch.Generator().manual_seed(90)
    a = torch.randint(-2, 3, (2, 70, 2), generator=g).to(dtype)
    b = torch.randint(-2, 3, (2, 101, 2), generator=g).to(dtype)
    a[0, 3], a[0, 4, 1], b[1, 5, 0] = math.inf, math.nan, math.nan
    for lengths in ((None, None), (torch.tensor([70, 9]), torch.tensor([1, 100]))):
        v, i = fused.pairwise_topk(a, b, 1, lengths_a=lengths[0], lengths_b=lengths[1])
        rv, ri = ref.pairwise_topk(a, b, 1, lengths_a=lengths[0], lengths_b=lengths[1])
        assert torch.equal(i, ri)
        torch.testing.assert_close(v, rv, rtol=0, atol=0, equal_nan=True)
    assert v[0, 3].isinf() and v[0, 4].isnan()


def test_topk_k_bounds():
    a, b = make((4, 3), seed=43), make((6, 3), seed=44)
    v, i = fused.pairwise_topk(a, b, 0)
    assert v.shape == i.shape == (4, 0)
    v, i = fused.pairwise_topk(a, b, 6)
    assert torch.equal(i.sort(-1).values, torch.arange(6).expand(4, 6))
    with raises("fused.pairwise_topk: k"):
        fused.pairwise_topk(a, b, 7)
    with raises("fused.pairwise_topk: k"):
        fused.pairwise_topk(a, b, -1)


def test_topk_nan_ranks_like_torch_topk():
    a, b = make((3, 3), seed=45), make((8, 3), seed=46)
    b[2, 0] = math.nan
    for largest in (False, True):
        v, i = fused.pairwise_topk(a, b, 8, largest=largest)
        rv, ri = ref.pairwise_topk(a, b, 8, largest=largest)
        assert torch.equal(i, ri)
        torch.testing.assert_close(v, rv, equal_nan=True)


@pytest.mark.parametrize("D", [3, 64])
@pytest.mark.parametrize("p", [2.0, 1.0, 3.0])
def test_topk_gradients_flow_through_the_selected_pairs(D, p):
    a = make((2, 7, D), torch.float64, seed=47, requires_grad=True)
    b = make((1, 30, D), torch.float64, seed=48, requires_grad=True)
    v, i = fused.pairwise_topk(a, b, 4, p)
    g = make(v.shape, torch.float64, seed=49)
    ours = torch.autograd.grad(v, (a, b), g)
    rv = ref.pairwise_distances(a, b, p).gather(-1, i)
    theirs = torch.autograd.grad(rv, (a, b), g)
    assert ours[0].shape == a.shape and ours[1].shape == b.shape
    for o, t in zip(ours, theirs):
        assert_close(o, t)


def test_topk_large_m_without_the_matrix():
    a, b = make((33, 3), seed=50), make((5000, 3), seed=51)
    v, i = fused.pairwise_topk(a, b, 7)
    rv, ri = torch.cdist(a.double(), b.double()).topk(7, largest=False)
    torch.testing.assert_close(v.double(), rv, rtol=1e-6, atol=1e-6)
    assert (i == ri).float().mean() > 0.99  # float32 rounding may swap near-ties


def test_matmul_path_copies_b_only_to_center_it(knn_filter):
    """The p = 2 matmul path centers the points at b's mean only where that mean is large against b's rows (points
    far from the origin); otherwise the float32 GEMM reads a and b as they are, and a call allocates far less than
    b. An int8 filter (topk) adds the int8 codes of the GEMM's operands, a quarter of b (and a few floats a row)."""

    def allocated_mb(a, b):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            fused.pairwise_topk(a, b, 4)
        return sum(max(e.cpu_memory_usage, 0) for e in prof.events() if e.cpu_memory_usage) / 2**20

    a, b = make((8, 64), seed=97), make((20000, 64), seed=98)
    b_mb = b.numel() * b.element_size() / 2**20
    copy_mb = b_mb / 4 if knn_filter == "int8" else 0
    assert copy_mb <= allocated_mb(a, b) < copy_mb + b_mb / 4
    assert allocated_mb(a + 100, b + 100) >= b_mb + copy_mb


def test_topk_memory_does_not_grow_with_n_times_m():
    """In a fresh process: pairwise_topk over 16384 x 16384 pairs (the matrix would take 1 GiB) raises the peak
    resident memory by far less than the matrix, on both the direct and the matmul path."""
    code = """
import resource, torch, fused
torch.manual_seed(0)
for d in (3, 32):
    a, b = torch.randn(16384, d), torch.randn(16384, d)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    v, i = fused.pairwise_topk(a, b, 8)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base
    assert v.shape == (16384, 8)
    print(grown // 1024)
"""
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    for grown_mb in map(int, out.stdout.split()):
        assert grown_mb < 128, f"peak memory grew by {grown_mb} MB"


# ---- padded batches: lengths_a / lengths_b ----
def padded_clouds(dtype=torch.float32, device="cpu", D=3, seed=70):
    """Three clouds of 9 and 13 padded rows: a full one, a short one, an empty one (lengths 0 and 1 included).
    Returns (a, b, a with NaN in its padded rows, b likewise, lengths_a, lengths_b): the NaN rows must never be
    read."""
    a, b = make((3, 9, D), dtype, device, seed=seed), make((3, 13, D), dtype, device, seed=seed + 1)
    la = torch.tensor([9, 4, 0], device=device)
    lb = torch.tensor([13, 1, 6], device=device)
    a_nan, b_nan = a.clone(), b.clone()
    for t, lengths in ((a_nan, la), (b_nan, lb)):
        for i, n in enumerate(lengths.tolist()):
            t[i, n:] = math.nan
    return a, b, a_nan, b_nan, la, lb


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("D", DIMS)
@pytest.mark.parametrize("p", [2.0, 1.0, math.inf, 0.5])
def test_distances_with_lengths(dev, dtype, D, p):
    a, b, a_nan, b_nan, la, lb = padded_clouds(dtype, dev, D)
    out = fused.pairwise_distances(a_nan, b_nan, p, lengths_a=la, lengths_b=lb)
    expected = ref.pairwise_distances(a, b, p, lengths_a=la, lengths_b=lb)
    assert_close(out, expected, scale=2.0 if dtype in (torch.float16, torch.bfloat16) else 1.0)
    assert not out.isnan().any()
    assert not out[1, 4:].any() and not out[1, :, 1:].any() and not out[2, 0:].any() and not out[2, :, 6:].any()


@pytest.mark.parametrize("D", DIMS)
@pytest.mark.parametrize("p", [2.0, 1.0, 3.0])
def test_distances_with_lengths_gradients(dev, D, p):
    """Padded pairs get no gradient: the gradients of the reference (on clean inputs) and exact zeros in padded
    rows, though ours read NaN there if they read them at all."""
    a, b, a_nan, b_nan, la, lb = padded_clouds(torch.float64, dev, D, seed=72)
    g = make((3, 9, 13), torch.float64, dev, seed=74)
    a_nan.requires_grad_(), b_nan.requires_grad_(), a.requires_grad_(), b.requires_grad_()
    ours = torch.autograd.grad(fused.pairwise_distances(a_nan, b_nan, p, lengths_a=la, lengths_b=lb), (a_nan, b_nan), g)
    theirs = torch.autograd.grad(ref.pairwise_distances(a, b, p, lengths_a=la, lengths_b=lb), (a, b), g)
    for o, t in zip(ours, theirs):
        assert_close(o, t, scale=10.0)
    assert not ours[0][1, 4:].any() and not ours[0][2].any() and not ours[1][1, 1:].any()


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("D", DIMS)
@pytest.mark.parametrize("k,p,largest", [(1, 2.0, False), (5, 2.0, False), (13, 1.0, False), (4, 2.0, True)])
def test_topk_with_lengths(dev, dtype, D, k, p, largest):
    """A row of a never picks a padded row of b; slots past the valid rows of b, and every slot of a padded row
    of a, hold index -1 and value inf (-inf when largest)."""
    a, b, a_nan, b_nan, la, lb = padded_clouds(dtype, dev, D, seed=76)
    v, i = fused.pairwise_topk(a_nan, b_nan, k, p, largest=largest, lengths_a=la, lengths_b=lb)
    rv, ri = ref.pairwise_topk(a, b, k, p, largest=largest, lengths_a=la, lengths_b=lb)
    assert v.dtype == dtype and i.dtype == torch.int64 and v.shape == i.shape == (3, 9, k)
    assert torch.equal(i == -1, ri == -1)
    assert torch.equal(v == (-math.inf if largest else math.inf), i == -1)
    assert (i[1, 4:] == -1).all() and (i[2] == -1).all() and (i[1, :4, 1:] == -1).all()
    assert_close(v, rv, scale=2.0)
    if dtype == torch.float64:
        assert torch.equal(i, ri)


@pytest.mark.parametrize("p", [2.0, 1.0])
def test_topk_with_lengths_gradients(dev, p):
    a, b, a_nan, b_nan, la, lb = padded_clouds(torch.float64, dev, 3, seed=78)
    a_nan.requires_grad_(), b_nan.requires_grad_(), a.requires_grad_(), b.requires_grad_()
    v, i = fused.pairwise_topk(a_nan, b_nan, 5, p, lengths_a=la, lengths_b=lb)
    g = make(v.shape, torch.float64, dev, seed=79)
    ours = torch.autograd.grad(v, (a_nan, b_nan), g)
    rv = ref.pairwise_distances(a, b, p).gather(-1, i.clamp(min=0))
    theirs = torch.autograd.grad(rv, (a, b), torch.where(i >= 0, g, 0.0))
    for o, t in zip(ours, theirs):
        assert_close(o, t)
    assert not ours[0][2].any() and not ours[1][1, 1:].any()


def test_lengths_broadcast_with_the_batch():
    """lengths have the batch shape of their own tensor: [1] for a cloud of a broadcast against 3 clouds of b."""
    a, b = make((1, 6, 3), seed=80), make((3, 8, 3), seed=81)
    la, lb = torch.tensor([4]), torch.tensor([8, 2, 5])
    out = fused.pairwise_distances(a, b, lengths_a=la, lengths_b=lb)
    assert out.shape == (3, 6, 8)
    assert_close(out, ref.pairwise_distances(a, b, lengths_a=la, lengths_b=lb))
    v, i = fused.pairwise_topk(a, b, 3, lengths_a=la, lengths_b=lb)
    rv, ri = ref.pairwise_topk(a, b, 3, lengths_a=la, lengths_b=lb)
    assert torch.equal(i, ri)
    a2 = make((6, 3), seed=82)  # no batch dims: lengths of shape ()
    assert_close(
        fused.pairwise_distances(a2, b, lengths_a=torch.tensor(2)),
        ref.pairwise_distances(a2, b, lengths_a=torch.tensor(2)),
    )


@pytest.mark.parametrize("op", ["pairwise_distances", "pairwise_topk"])
def test_bad_lengths(op):
    a, b = make((2, 4, 3)), make((2, 5, 3))
    call = (
        (lambda **kw: fused.pairwise_distances(a, b, **kw))
        if op == "pairwise_distances"
        else (lambda **kw: fused.pairwise_topk(a, b, 2, **kw))
    )
    with raises(f"fused.{op}: lengths_a has a length 5 larger than the padded size 4"):
        call(lengths_a=torch.tensor([4, 5]))
    with raises(f"fused.{op}: lengths_b must not be negative, got -1"):
        call(lengths_b=torch.tensor([-1, 5]))
    with raises(f"fused.{op}: lengths_a must be an int64 tensor"):
        call(lengths_a=torch.tensor([1, 2], dtype=torch.int32))
    with raises(rf"fused.{op}: lengths_b must have the batch shape of b \[2\]"):
        call(lengths_b=torch.tensor([1, 2, 3]))
    with raises(f"fused.{op}: lengths_a is on meta but a is on cpu"):
        call(lengths_a=torch.tensor([1, 2], device="meta"))


# ---- torch.autocast ----
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_runs_in_float32_as_torch_cdist(dtype):
    """torch.cdist runs in float32 under CPU autocast (aten's autocast fp32 list): so does the distance family,
    through the public functions and torch.ops.fused alike, with the same values as on float32 inputs and the
    gradients in the inputs' dtype; float64 stays float64."""
    a, b = make((2, 9, 5), dtype, seed=1).requires_grad_(), make((2, 7, 5), dtype, seed=2)
    a32, b32 = a.detach().float(), b.float()
    calls = {
        "pairwise_distances": (lambda x, y: fused.pairwise_distances(x, y), torch.ops.fused.pairwise_distances),
        "pairwise_topk": (
            lambda x, y: fused.pairwise_topk(x, y, 3)[0],
            lambda x, y: torch.ops.fused.pairwise_topk(x, y, 3)[0],
        ),
        "radius_neighbors": (
            lambda x, y: fused.radius_neighbors(x, y, 2.0, 3)[0],
            lambda x, y: torch.ops.fused.radius_neighbors(x, y, 2.0, 3)[0],
        ),
        "chamfer_distance": (
            lambda x, y: fused.chamfer_distance(x, y),
            lambda x, y: torch.ops.fused.chamfer_distance(x, y)[0],
        ),
    }
    with torch.autocast("cpu", dtype=dtype):
        assert torch.cdist(a, b).dtype == torch.float32
        for name, (public, dispatched) in calls.items():
            for fn in (public, dispatched):
                out = fn(a, b)
                assert out.dtype == torch.float32, name
                assert torch.equal(out, fn(a32, b32)), name
                fin = out[out.isfinite()]
                (grad,) = torch.autograd.grad(fin.sum(), a)
                assert grad.dtype == dtype, name
            assert fn(a.double(), b.double()).dtype == torch.float64, name


# ---- errors ----
def test_bad_inputs():
    a, b = make((4, 3)), make((5, 3))
    with raises("fused.pairwise_distances: a must be a floating-point"):
        fused.pairwise_distances(a.int(), b)
    with raises("fused.pairwise_distances: b has dtype"):
        fused.pairwise_distances(a, b.double())
    with raises("fused.pairwise_distances: a and b must have the same last dim"):
        fused.pairwise_distances(a, make((5, 4)))
    with raises("fused.pairwise_distances: the batch dims"):
        fused.pairwise_distances(make((2, 4, 3)), make((3, 5, 3)))
    with raises("fused.pairwise_distances: a must have at least 2 dims"):
        fused.pairwise_distances(make((3,)), b)
    with raises("fused.pairwise_distances: p must be"):
        fused.pairwise_distances(a, b, -1.0)
    with raises("fused.pairwise_distances: squared=True needs p=2"):
        fused.pairwise_distances(a, b, 1.0, squared=True)
    with raises("fused.pairwise_topk: b has dtype"):
        fused.pairwise_topk(a, b.half(), 2)


# ---- torch.compile (opcheck: tests/test_op_coverage.py) ----
def test_compile():
    a, b = make((2, 6, 3), seed=54), make((2, 8, 3), seed=55)
    la, lb = torch.tensor([6, 2]), torch.tensor([1, 8])
    check_compile(lambda x, y: fused.pairwise_distances(x, y, 1.0), a, b)
    check_compile(lambda x, y: fused.pairwise_topk(x, y, 3), a, b)
    check_compile(lambda x, y, u, w: fused.pairwise_topk(x, y, 3, lengths_a=u, lengths_b=w), a, b, la, lb)

    check_compile_grads(
        lambda x, y: (fused.pairwise_distances(x, y) * y.sum()).sum() + fused.pairwise_topk(x, y, 2)[0].sum(), a, b
    )


# ---- Triton launchers (under TRITON_INTERPRET=1 on CPU where there is no GPU) ----


def triton_kernels():
    from fused.distance import triton_kernels as tk

    return tk


@requires_triton
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("D", [3, 40])  # D = 40: the tensor-core path for p = 2 (not float64)
@pytest.mark.parametrize("p", [0.0, 1.0, 2.0, 0.5, math.inf])
def test_triton_distances_and_topk(dtype, D, p):
    tk = triton_kernels()
    a = make((2, 41, D), dtype, TRITON_DEVICE, seed=60)
    b = make((1, 70, D), dtype, TRITON_DEVICE, seed=61)
    out = tk.pairwise_distances(a, b, p)
    assert out.shape == (2, 41, 70) and out.dtype == dtype
    assert_close(out.cpu(), ref.pairwise_distances(a.cpu(), b.cpu(), p), scale=2.0)
    v, i = tk.pairwise_topk(a, b, 5, p, largest=p == 0.5)
    rv, ri = ref.pairwise_topk(a.cpu(), b.cpu(), 5, p, largest=p == 0.5)
    assert_close(v.cpu(), rv, scale=2.0)
    # The selection sees the values it returns: bitwise on the direct path under the interpreter. The matmul path's
    # tl.dot is numpy's matmul there, whose summation order depends on the tile shape (1 ulp between the kernels).
    matmul_path = p == 2 and D >= 32 and dtype != torch.float64
    if TRITON_DEVICE == "cpu" and not matmul_path:
        assert torch.equal(v, out.gather(-1, i))
    else:
        assert_close(v, out.gather(-1, i))
    if dtype == torch.float64:
        assert torch.equal(i.cpu(), ri)


@requires_triton
@pytest.mark.parametrize("D", [3, 40])
@pytest.mark.parametrize("p", [1.0, 2.0, 0.7, math.inf])
def test_triton_backward(D, p):
    tk = triton_kernels()
    a = make((2, 37, D), torch.float64, TRITON_DEVICE, seed=62)
    b = make((1, 20, D), torch.float64, TRITON_DEVICE, seed=63)
    d = ref.pairwise_distances(a, b, p)
    g = make(d.shape, torch.float64, TRITON_DEVICE, seed=64)
    ours = tk.pairwise_distances_backward(g, a, b, d, p, False)
    expected = torch.ops.fused.pairwise_distances_backward(g.cpu(), a.cpu(), b.cpu(), d.cpu(), p, False)
    for o, e in zip(ours, expected):
        assert o.shape == e.shape
        assert_close(o.cpu(), e)
    v, i = tk.pairwise_topk(a, b, 4, p)
    gv = make(v.shape, torch.float64, TRITON_DEVICE, seed=65)
    ours = tk.pairwise_topk_backward(gv, a, b, v, i, p, False)
    expected = torch.ops.fused.pairwise_topk_backward(gv.cpu(), a.cpu(), b.cpu(), v.cpu(), i.cpu(), p, False)
    for o, e in zip(ours, expected):
        assert_close(o.cpu(), e)


@requires_triton
@pytest.mark.parametrize("p", [2.0, 1.0])
def test_triton_topk_backward_sums_grad_b_in_a_fixed_order(p):
    # Few points in b, many rows: every point of b is selected by many pairs. The segment sum adds them in the
    # pairs' (batch, row, rank) order, the CPU kernel's order: with p = 1 each term is exactly +-grad, so only
    # the order of the sums can make the two differ, and they agree bit for bit, run after run.
    tk = triton_kernels()
    a = make((2, 40, 5), torch.float32, TRITON_DEVICE, seed=66)
    b = make((1, 6, 5), torch.float32, TRITON_DEVICE, seed=67)
    v, i = tk.pairwise_topk(a, b, 4, p)
    g = make(v.shape, torch.float32, TRITON_DEVICE, seed=68)
    first = tk.pairwise_topk_backward(g, a, b, v, i, p, False)
    again = tk.pairwise_topk_backward(g, a, b, v, i, p, False)
    cpu = torch.ops.fused.pairwise_topk_backward(g.cpu(), a.cpu(), b.cpu(), v.cpu(), i.cpu(), p, False)
    assert torch.equal(first[1], again[1])
    if p == 1.0:
        assert torch.equal(first[1].cpu(), cpu[1])
    assert_close(first[1].cpu(), cpu[1])
    assert first[1].abs().sum() > 0


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("D", [3, 40])
def test_triton_with_lengths(dtype, D):
    """The Triton launchers with padded batches (NaN in the padded rows): distances, topk (nearest and farthest),
    and both backwards, against the references and the CPU kernels."""
    tk = triton_kernels()
    a, b, a_nan, b_nan, la, lb = (t.to(TRITON_DEVICE) for t in padded_clouds(dtype, "cpu", D, seed=84))
    out = tk.pairwise_distances(a_nan, b_nan, 2.0, False, la, lb)
    assert_close(out.cpu(), ref.pairwise_distances(a.cpu(), b.cpu(), lengths_a=la.cpu(), lengths_b=lb.cpu()))
    for k, largest in ((1, False), (5, False), (4, True)):
        v, i = tk.pairwise_topk(a_nan, b_nan, k, 2.0, False, largest, la, lb)
        rv, ri = ref.pairwise_topk(a.cpu(), b.cpu(), k, largest=largest, lengths_a=la.cpu(), lengths_b=lb.cpu())
        assert torch.equal(i.cpu(), ri)
        assert_close(v.cpu(), rv)
    g = make(out.shape, dtype, TRITON_DEVICE, seed=86)
    ours = tk.pairwise_distances_backward(g, a_nan, b_nan, out, 2.0, False, la, lb)
    cpu = torch.ops.fused.pairwise_distances_backward(
        g.cpu(), a_nan.cpu(), b_nan.cpu(), out.cpu(), 2.0, False, la.cpu(), lb.cpu()
    )
    for o, c in zip(ours, cpu):
        assert_close(o.cpu(), c)
    v, i = tk.pairwise_topk(a_nan, b_nan, 5, 2.0, False, False, la, lb)
    gv = make(v.shape, dtype, TRITON_DEVICE, seed=87)
    ours = tk.pairwise_topk_backward(gv, a_nan, b_nan, v, i, 2.0, False)
    cpu = torch.ops.fused.pairwise_topk_backward(gv.cpu(), a_nan.cpu(), b_nan.cpu(), v.cpu(), i.cpu(), 2.0, False)
    for o, c in zip(ours, cpu):
        assert_close(o.cpu(), c)
        assert not o.isnan().any()


@requires_triton
def test_triton_edge_cases():
    tk = triton_kernels()
    a = torch.tensor([[0.0, 0.0], [1.0, 1.0]], device=TRITON_DEVICE)
    b = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [0.0, 0.0], [0.0, -1.0], [2.0, 2.0]], device=TRITON_DEVICE)
    v, i = tk.pairwise_topk(a, b, 4)
    assert i.tolist() == [[3, 0, 1, 2], [0, 1, 3, 5]]
    far = torch.full((3, 1), 512695.0, device=TRITON_DEVICE)
    assert torch.equal(tk.pairwise_distances(far, far + 109), torch.full((3, 3), 109.0, device=TRITON_DEVICE))
    x = make((20, 40), seed=66, device=TRITON_DEVICE)  # tensor-core path: duplicates recomputed to exact 0
    assert torch.equal(tk.pairwise_distances(x, x).diagonal().cpu(), torch.zeros(20))
    bn = make((7, 3), seed=67, device=TRITON_DEVICE)
    bn[2, 0] = math.nan
    for largest in (False, True):
        v, i = tk.pairwise_topk(bn[:3], bn, 7, largest=largest)
        rv, ri = ref.pairwise_topk(bn[:3].cpu(), bn.cpu(), 7, largest=largest)
        assert torch.equal(i.cpu(), ri)
    assert tk.pairwise_distances(make((0, 3), device=TRITON_DEVICE), b[:, :1].expand(6, 3)).shape == (0, 6)
    old = tk.MAX_TOPK_REGISTERS
    try:  # large k: the row-chunk fallback
        tk.MAX_TOPK_REGISTERS = 2
        for largest in (False, True):  # NaN is the largest value, as in torch.topk
            v, i = tk.pairwise_topk(bn, bn, 5, largest=largest)
            rv, ri = ref.pairwise_topk(bn.cpu(), bn.cpu(), 5, largest=largest)
            assert torch.equal(i.cpu(), ri)
        # float64 distances that differ below float32's resolution keep their order
        near = torch.tensor([[0.0], [1.0 + 2**-40], [1.0], [1.0 + 2**-41]], dtype=torch.float64, device=TRITON_DEVICE)
        assert tk.pairwise_topk(near[:1], near, 3)[1].tolist() == [[0, 2, 3]]
    finally:
        tk.MAX_TOPK_REGISTERS = old


# ---- GPU only ----
@requires_cuda
def test_cuda_distances_beyond_2_to_the_31():
    a = make((46400, 3), device="cuda", seed=56)
    b = make((46400, 3), device="cuda", seed=57)
    assert a.shape[0] * b.shape[0] > 2**31
    for bk in ("cuda", "triton"):
        with backend(bk):
            out = fused.pairwise_distances(a, b)
        assert_close(out[-3:, -5:], ref.pairwise_distances(a[-3:], b[-5:]))
        del out


@requires_cuda
def test_cuda_topk_memory_does_not_grow_with_n_times_m():
    a = make((20000, 16), device="cuda", seed=58)
    b = make((20000, 16), device="cuda", seed=59)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    v, i = fused.pairwise_topk(a, b, 8)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base < 64 * 2**20  # the matrix would be 1.6 GB
    rv, ri = ref.pairwise_topk(a[:5].cpu(), b.cpu(), 8)
    assert_close(v[:5].cpu(), rv)


@requires_triton
def test_triton_bfloat16_outputs_round_to_nearest_even():
    """Distances rounded to bfloat16 as a GPU rounds them (to nearest even; the interpreter's own conversion
    truncates), in the output and in the ranking: 1 + 5/256 and 1 + 3/256 (p = 1, exact in float32) both round to
    1 + 4/256, a tie that goes to the lower index (truncated, 1 + 3/256 would become 1 + 2/256 and rank first)."""
    tk = triton_kernels()
    a = torch.zeros(1, 2, dtype=torch.bfloat16, device=TRITON_DEVICE)
    b = torch.tensor([[1.0, 5 / 256], [1.0, 3 / 256]], dtype=torch.bfloat16, device=TRITON_DEVICE)
    tie = torch.tensor([[1 + 4 / 256] * 2], dtype=torch.bfloat16)
    assert torch.equal(tk.pairwise_distances(a, b, 1.0).cpu(), tie)
    v, i = tk.pairwise_topk(a, b, 2, 1.0)
    assert torch.equal(v.cpu(), tie) and i.tolist() == [[0, 1]]
    cpu = torch.ops.fused.pairwise_topk(a.cpu(), b.cpu(), 2, 1.0, False, False, None, None)
    assert torch.equal(v.cpu(), cpu[0]) and torch.equal(i.cpu(), cpu[1])


@requires_triton
def test_triton_topk_backward_skips_the_missing_pairs():
    """The segment sum leaves the run of missing pairs (key = number of points, sorted last) alone, as the CUDA
    kernel does: no program walks it (a sparse radius_neighbors has millions of them)."""
    tk = triton_kernels()
    points, d = 3, 4
    keys = torch.tensor([0, 0, 2, points, points, points, -1], device=TRITON_DEVICE)  # sorted, then the sentinel
    term = make((6, d), torch.float32, TRITON_DEVICE, seed=69)
    out = torch.full((points + 1, d), 7.0, device=TRITON_DEVICE)  # row `points`: must stay untouched
    order = torch.arange(6, device=TRITON_DEVICE)
    tk._segment_sum_kernel[(6, 1)](term, order, keys, out, points, d, tk.tl.float32, d)
    assert torch.equal(out[0], -(term[0] + term[1])) and torch.equal(out[2], -term[2])
    assert (out[[1, points]] == 7.0).all()


@requires_triton
def test_triton_select_by_chunks_bounds_the_chunk_over_the_batch(monkeypatch):
    """Many neighbours per row: each chunk holds at most SELECT_CHUNK distances over the whole batch (rows of a x
    batch x M), and the results are the reference's."""
    tk = triton_kernels()
    chunks = []
    distances = tk.pairwise_distances

    def spy(*args):
        out = distances(*args)
        chunks.append(out.numel())
        return out

    monkeypatch.setattr(tk, "pairwise_distances", spy)
    monkeypatch.setattr(tk, "MAX_TOPK_REGISTERS", 2)
    monkeypatch.setattr(tk, "SELECT_CHUNK", 256)
    a = make((4, 10, 3), torch.float64, TRITON_DEVICE, seed=70)
    b = make((4, 20, 3), torch.float64, TRITON_DEVICE, seed=71)
    v, i = tk.pairwise_topk(a, b, 6, 1.0)
    rv, ri = ref.pairwise_topk(a.cpu(), b.cpu(), 6, 1.0)
    assert torch.equal(i.cpu(), ri) and torch.equal(v.cpu(), rv)
    assert len(chunks) == 4 and max(chunks) <= 256, chunks  # 3 rows x 4 batches x 20 points per chunk


def test_selection_routes_long_rows_to_triton():
    """Under `auto` with the CUDA kernels built, rows longer than the CUDA select kernel's shared-memory tile
    (8192 coordinates in float32 and 16-bit, 4096 in float64) go to Triton, which takes any D."""
    from fused.distance import ops

    def routed(dtype, d, p):
        a, b = torch.empty(2, 5, d, dtype=dtype, device="meta"), torch.empty(2, 7, d, dtype=dtype, device="meta")
        topk, radius = ops._topk_triton_path(a, b, 3, p), ops._radius_triton_path(a, b, 1.0, 3, None, None, p)
        assert topk == radius
        return topk

    header = open(os.path.join(os.path.dirname(__file__), "..", "csrc", "distance", "distance_kernels.h")).read()
    assert f"constexpr int kSelectTileBytes = {ops.SELECT_TILE_BYTES};" in header
    for dtype, limit in ((torch.float32, 8192), (torch.bfloat16, 8192), (torch.float16, 8192), (torch.float64, 4096)):
        for p in (1.0, math.inf, 3.0) + ((2.0,) if dtype == torch.float64 else ()):
            assert not routed(dtype, limit, p) and routed(dtype, limit + 1, p), (dtype, p)


@requires_triton
def test_triton_p2_accumulates_with_fma_without_fp_fusion():
    """The p = 2 direct path built for sm_90 with Triton's FP fusion off (Triton 3.10's default): its
    accumulation is still an fma (tl.fma), the C++ kernels' arithmetic, so ties rank the same on every backend."""
    import re

    stdout = compile_for_sm90(["distance_unfused"])
    for name in ("_distances_kernel", "_topk_kernel"):
        m = re.search(rf"compiled {name}: .*fma.rn.f32 (\d+), .*float64 variants (\d+), fma.rn.f64 (\d+)", stdout)
        assert m and int(m[1]) > 0 and int(m[2]) > 0 and int(m[3]) > 0, stdout
