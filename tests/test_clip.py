"""fused.clip_grad_norm_ against torch.nn.utils.clip_grad_norm_."""

import math

import pytest
import torch
from harness import assert_accuracy, raises

import fused

SHAPES = [(3, 5, 131), (70001,), (1,), (0,), (4, 4)]


def params_with_grads(dtype=torch.float32, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    ps = [torch.zeros(s, dtype=dtype, requires_grad=True) for s in SHAPES]
    for p in ps:
        p.grad = (torch.randn(p.shape, generator=g, dtype=torch.float64) * scale).to(dtype)
    return ps


def clone(ps):
    out = [p.detach().clone().requires_grad_() for p in ps]
    for o, p in zip(out, ps):
        o.grad = p.grad.clone()
    return out


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf, 3.0, 0.5])
@pytest.mark.parametrize("max_norm", [0.5, 1e9])
def test_matches_torch(norm_type, max_norm):
    ours = params_with_grads()
    theirs = clone(ours)
    norm = fused.clip_grad_norm_(ours, max_norm, norm_type)
    # torch's foreach inf-norm rejects empty tensors; they add nothing to any norm
    ref = torch.nn.utils.clip_grad_norm_([q for q in theirs if q.numel()], max_norm, norm_type, foreach=True)
    torch.testing.assert_close(norm, ref, rtol=1e-5, atol=0)
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_dtypes(dtype):
    """The norm is accumulated in fp32 (fp64 for fp64) and returned in the gradients' dtype, as torch's; the norm
    and the clipped gradients are as close to a float64 run as torch's in that dtype."""
    ours = params_with_grads(dtype, scale=10.0)
    theirs = clone(ours)
    exact = [p.detach().double().requires_grad_() for p in ours]
    for e, p in zip(exact, ours):
        e.grad = p.grad.double()
    norm = fused.clip_grad_norm_(ours, 1.0)
    ref = torch.nn.utils.clip_grad_norm_(theirs, 1.0)
    exact_norm = torch.nn.utils.clip_grad_norm_(exact, 1.0)
    assert norm.dtype == ref.dtype == dtype
    assert_accuracy(norm.reshape(1), ref.reshape(1), exact_norm.reshape(1))
    for p, q, e in zip(ours, theirs, exact):
        if p.numel():
            assert_accuracy(p.grad, q.grad, e.grad)


def test_mixed_dtypes_norm_dtype():
    """Mixed gradient dtypes: the norm comes back in their promoted dtype, as torch.stack promotes in torch's."""
    for dtypes, want in [
        ((torch.float16, torch.bfloat16), torch.float32),
        ((torch.float32, torch.float64), torch.float64),
    ]:
        ps = [torch.zeros(4, dtype=d, requires_grad=True) for d in dtypes]
        for p in ps:
            p.grad = torch.full((4,), 3.0, dtype=p.dtype)
        ref = torch.nn.utils.clip_grad_norm_(clone(ps), 1.0)
        norm = fused.clip_grad_norm_(ps, 1.0)
        assert norm.dtype == ref.dtype == want
        torch.testing.assert_close(norm, ref)
        assert torch.ops.fused.clip_grad_norm_([p.grad for p in clone(ps)], 1.0).dtype == want


def test_float64_as_torch():
    """The issue's case: float64 gradients give torch's float64 norm, and clipped gradients within float64
    rounding of torch's (they were 2.4e-8 apart when the norm was taken in float32)."""
    g = torch.Generator().manual_seed(0)
    ps = [torch.zeros(1000, dtype=torch.float64, requires_grad=True)]
    ps[0].grad = torch.randn(1000, dtype=torch.float64, generator=g)
    theirs = clone(ps)
    norm, ref = fused.clip_grad_norm_(ps, 1.0), torch.nn.utils.clip_grad_norm_(theirs, 1.0)
    assert norm.dtype == torch.float64
    torch.testing.assert_close(norm, ref, rtol=1e-15, atol=0)
    torch.testing.assert_close(ps[0].grad, theirs[0].grad, rtol=1e-15, atol=1e-17)


def test_single_tensor_and_no_grads():
    p = torch.zeros(10, requires_grad=True)
    p.grad = torch.full((10,), 2.0)
    torch.testing.assert_close(fused.clip_grad_norm_(p, 1.0), torch.tensor(math.sqrt(40.0)))
    torch.testing.assert_close(p.grad.norm(), torch.tensor(1.0), rtol=1e-5, atol=0)
    assert fused.clip_grad_norm_([torch.zeros(3, requires_grad=True)], 1.0).item() == 0.0


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf, 3.0])
@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_nonfinite_as_torch(bad, norm_type):
    ours = params_with_grads()
    ours[1].grad[7] = bad
    theirs = clone(ours)
    norm = fused.clip_grad_norm_(ours, 1.0, norm_type)  # the inf-norm of NaN grads is NaN, as torch's
    # torch's clip_grad_norm_, spelled out (its inf-norm refuses the empty gradient in the list)
    grads = [q.grad for q in theirs]
    ref = torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads]), norm_type)
    torch._foreach_mul_(grads, torch.clamp(1.0 / (ref + 1e-6), max=1.0))
    torch.testing.assert_close(norm, ref, equal_nan=True)
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p.grad, q.grad, equal_nan=True)
    with raises("fused.clip_grad_norm_: The total norm of order 2.0 for gradients from `parameters` is non-finite"):
        fused.clip_grad_norm_(clone(ours), 1.0, error_if_nonfinite=True)


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_strided_grads(norm_type):
    """Strided (non-dense) and transposed gradients are clipped in place, keeping their layout, as torch's."""
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(20, 20, generator=g)
    ours = [
        torch.zeros(20, 5, requires_grad=True),
        torch.zeros(20, 20, requires_grad=True),
        torch.zeros(20, 5, requires_grad=True),
    ]
    ours[0].grad, ours[1].grad = wide[:, :5], wide.t().contiguous().t()
    ours[2].grad = torch.randn(20, 5, generator=g)
    theirs = clone(ours)
    norm = fused.clip_grad_norm_(ours, 1.0, norm_type)
    ref = torch.nn.utils.clip_grad_norm_(theirs, 1.0, norm_type)
    torch.testing.assert_close(norm, ref, rtol=1e-6, atol=0)
    assert ours[0].grad.stride() == (20, 1) and ours[1].grad.stride() == (1, 20)
    assert ours[0].grad.data_ptr() == wide.data_ptr()  # written in place: the view's base holds the result
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7)


def test_expanded_grads_are_refused_as_torch():
    """A gradient that overlaps itself cannot be scaled in place: torch's clip_grad_norm_ fails on it; ours says so
    by name before it changes anything."""
    p, q = torch.zeros(4, 5, requires_grad=True), torch.zeros(3, requires_grad=True)
    p.grad, q.grad = torch.ones(5).expand(4, 5), torch.full((3,), 7.0)
    with raises(r"fused.clip_grad_norm_: a gradient of shape \(4, 5\) overlaps itself in memory"):
        fused.clip_grad_norm_([q, p], 1.0)
    assert torch.equal(q.grad, torch.full((3,), 7.0))
    with pytest.raises(RuntimeError, match="more than one element of the written-to tensor"):
        torch.nn.utils.clip_grad_norm_([q, p], 1.0)


def test_warnings_and_arguments_as_torch():
    """torch's warning for an exhausted generator (same text, pointing at the caller), norm_type as a string,
    foreach taken as torch takes it, no gradients: a float32 zero."""
    params = params_with_grads()
    gen = (p for p in params)
    list(gen)
    for clip in (fused.clip_grad_norm_, torch.nn.utils.clip_grad_norm_):
        with pytest.warns(UserWarning) as record:
            norm = clip(gen, 1.0)
        warning = "`parameters` is an empty generator, no gradient clipping will occur."
        assert [str(w.message) for w in record] == [warning]
        assert record[0].filename == __file__
        assert norm.dtype == torch.float32 and norm.item() == 0.0
    for norm_type in ("inf", "2", 3):
        exact = params_with_grads(torch.float64)
        exact_norm = torch.nn.utils.clip_grad_norm_([e for e in exact if e.numel()], 1.0, norm_type=norm_type)
        for foreach in (None, True, False):
            ours, theirs = params_with_grads(), params_with_grads()
            norm = fused.clip_grad_norm_(ours, 1.0, norm_type=norm_type, foreach=foreach)
            ref = torch.nn.utils.clip_grad_norm_(
                [q for q in theirs if q.numel()], 1.0, norm_type=norm_type, foreach=foreach
            )
            assert_accuracy(norm.reshape(1), ref.reshape(1), exact_norm.reshape(1))
            for p, q, e in zip(ours, theirs, exact):
                if p.numel():
                    assert_accuracy(p.grad, q.grad, e.grad)


@pytest.mark.parametrize("norm_type", [0, -0.5, -1.0, -math.inf, math.nan])
def test_orders_that_are_not_norms_run_torchs_definition(norm_type):
    """Orders <= 0 and NaN are not norms (0 counts the gradients with a nonzero entry): torch's own result."""
    ours = [p for p in params_with_grads(torch.float64) if p.numel()]  # torch refuses empty ones for p < 0
    ours[2].grad.zero_()
    theirs = clone(ours)
    norm = fused.clip_grad_norm_(ours, 0.5, norm_type)
    ref = torch.nn.utils.clip_grad_norm_(theirs, 0.5, norm_type)
    torch.testing.assert_close(norm, ref, equal_nan=True)
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p.grad, q.grad, equal_nan=True)


def test_bad_input():
    """A negative or NaN max_norm is refused (a contract choice: torch scales by a negative or NaN coefficient)."""
    for max_norm in (-1.0, math.nan):
        with raises("fused.clip_grad_norm_: max_norm must be >= 0"):
            fused.clip_grad_norm_(params_with_grads(), max_norm)
    a, b = torch.zeros(3, requires_grad=True), torch.zeros(3, device="meta", requires_grad=True)
    a.grad, b.grad = torch.ones(3), torch.ones(3, device="meta")
    with raises("fused.clip_grad_norm_: all parameters of one call must be on one device"):
        fused.clip_grad_norm_([a, b], 1.0)
    p = torch.zeros(10, requires_grad=True)
    p.grad = torch.sparse_coo_tensor([[1, 3]], [1.0, 2.0], (10,))
    with raises("fused.clip_grad_norm_: sparse gradients are not supported"):
        fused.clip_grad_norm_([p], 1.0)


def test_torch_ops_clip_grad_norm_takes_the_gradients():
    grads = [torch.randn(10, dtype=torch.float64) * 5, torch.randn(3, 4, dtype=torch.float64)]
    params = [torch.nn.Parameter(g.clone()) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    expected = torch.nn.utils.clip_grad_norm_(params, 1.0, norm_type=3.0)
    norm = torch.ops.fused.clip_grad_norm_(grads, 1.0, 3.0)
    torch.testing.assert_close(norm.double(), expected, rtol=1e-6, atol=0)
    for g, p in zip(grads, params):
        torch.testing.assert_close(g, p.grad, rtol=1e-6, atol=1e-12)
    with pytest.raises(ValueError, match=r"fused\.clip_grad_norm_: max_norm must be >= 0"):
        torch.ops.fused.clip_grad_norm_([torch.randn(3)], -1.0)
