"""Parity, accuracy, gradients, compile and bad-input tests of the fused elementwise family (CPU kernels, and
the CUDA backends when a GPU is present). The Triton launchers have their own file under the interpreter."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fused
from fused.elementwise import reference as ref
from tests.harness import (
    ALL_DTYPES,
    SEEDS,
    assert_accuracy,
    assert_accuracy_over_seeds,
    assert_close,
    check_compile,
    make,
    noncontiguous,
    raises,
    same_values,
)

ACTS = list(ref.ACT_FNS)
CHAINS = [
    ["square"] * 10,
    ["cos", "cos"],
    [("mul", 0.5), "tanh", ("add", 1.0)],
    ["sigmoid", "log", "neg", "exp", ("pow", 3.0), "sqrt", "rsqrt", "reciprocal"],
    ["abs", ("clamp_min", 0.25), ("clamp_max", 2.0), "relu", "gelu", "gelu_tanh", "silu", "sin", ("pow", 0.0)],
]


# ---------------------------------------------------------------- bias_act
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_bias_act_matches_reference(dev, act, dtype):
    x = make((3, 5, 131), dtype, dev)
    b = make((131,), dtype, dev)
    out = fused.bias_act(x, b, act)
    assert out.dtype == dtype and out.shape == x.shape
    assert_close(out, ref.bias_act(x, b, act))
    assert_accuracy(out, ref.bias_act(x, b, act), ref.bias_act(x.double(), b.double(), act))


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_bias_act_gradients_against_float64(dev, act, dtype):
    x = make((7, 33), dtype, dev, requires_grad=True)
    b = make((33,), dtype, dev, requires_grad=True)
    g = make((7, 33), dtype, dev, seed=1)
    gx, gb = torch.autograd.grad(fused.bias_act(x, b, act), (x, b), g)
    ex, eb = torch.autograd.grad(ref.bias_act(x, b, act), (x, b), g)
    x64, b64 = x.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    rx, rb = torch.autograd.grad(ref.bias_act(x64, b64, act), (x64, b64), g.double())
    assert_accuracy(gx, ex, rx)
    assert_accuracy(gb, eb, rb)


def test_bias_act_without_bias_and_large(dev):
    x = make((4096, 1027), torch.float32, dev)
    assert_close(fused.bias_act(x, None, "silu"), ref.bias_act(x, None, "silu"))
    x = make((), torch.float32, dev)
    assert_close(fused.bias_act(x, None, "tanh"), torch.tanh(x))


@pytest.mark.parametrize("rows, C", [(20000, 16), (4096, 512)])
@pytest.mark.parametrize("op", ["identity", "silu", "dropout_p0"])
def test_bias_gradient_over_many_rows_as_accurate_as_eager(rows, C, op):
    """The bias gradient sums a column over every row: pairwise (as torch's cascade sums), not in long float32 runs,
    which were 3-20x eager's error against float64 at 20000 rows. Judged over seeds: one set of C sums moves with
    the machine's summation order (eager's too)."""
    samples = []
    for seed in range(SEEDS):
        x = make((rows, C), seed=10 * seed + 5)
        b = make((C,), seed=10 * seed + 6, requires_grad=True)
        g = make((rows, C), seed=10 * seed + 7)
        if op == "dropout_p0":
            fn = lambda bias: fused.bias_dropout_add(x, bias, torch.zeros_like(x), p=0.0)  # noqa: E731
            eager_fn = lambda bias: x.to(bias.dtype) + bias  # noqa: E731
        else:
            fn = lambda bias: fused.bias_act(x, bias, op)  # noqa: E731
            eager_fn = lambda bias: ref.bias_act(x.to(bias.dtype), bias, op)  # noqa: E731
        ours = torch.autograd.grad(fn(b), b, g)[0]
        eager = torch.autograd.grad(eager_fn(b), b, g)[0]
        b64 = b.detach().double().requires_grad_()
        samples.append((ours, eager, torch.autograd.grad(eager_fn(b64), b64, g.double())[0]))
    assert_accuracy_over_seeds(samples)


def test_bias_act_large_bias_gradient_is_deterministic(dev):
    x = make((3000, 257), torch.float32, dev, requires_grad=True)
    b = make((257,), torch.float32, dev, requires_grad=True)
    g = make((3000, 257), torch.float32, dev, seed=2)
    first = torch.autograd.grad(fused.bias_act(x, b, "gelu"), b, g)[0]
    for _ in range(3):
        assert torch.equal(torch.autograd.grad(fused.bias_act(x, b, "gelu"), b, g)[0], first)
    b64 = b.detach().double().requires_grad_()
    expected = torch.autograd.grad(ref.bias_act(x.double(), b64, "gelu"), b64, g.double())[0]
    eager = torch.autograd.grad(ref.bias_act(x, b, "gelu"), b, g)[0]  # torch's float32 sums of the same terms
    # judged over the 257 sums against eager's error, not per sum: a sum of 3000 terms that cancel misses a relative
    # tolerance in any summation order (one did, 3.1e-5 off, in a CI run whose data differed from the one before)
    assert_accuracy(first, eager, expected)


def test_bias_act_noncontiguous_and_empty(dev):
    x = noncontiguous(make((6, 40), torch.float32, dev, requires_grad=True))
    b = noncontiguous(make((40,), torch.float32, dev, requires_grad=True))
    assert not x.is_contiguous()
    out = fused.bias_act(x, b, "gelu_tanh")
    assert_close(out, ref.bias_act(x, b, "gelu_tanh"))
    gx, gb = torch.autograd.grad(out.sum(), (x, b))
    ex, eb = torch.autograd.grad(ref.bias_act(x, b, "gelu_tanh").sum(), (x, b))
    assert_close(gx, ex)
    assert_close(gb, eb, scale=4)
    e = torch.empty(0, 5, device=dev, requires_grad=True)
    eb = torch.zeros(5, device=dev, requires_grad=True)
    out = fused.bias_act(e, eb, "relu")
    assert out.shape == (0, 5)
    gx, gb = torch.autograd.grad(out.sum(), (e, eb))
    assert gx.shape == (0, 5) and torch.equal(gb, torch.zeros(5, device=dev))


def test_bias_act_nan_inf_propagate_like_eager(dev):
    x = torch.tensor([[float("nan"), float("inf"), -float("inf"), 0.0, 1.0]], device=dev)
    for act in ACTS:
        expected = ref.bias_act(x, None, act)
        if act == "gelu":  # eager's CPU gelu gives NaN at +inf; the limit (and eager on CUDA) is +inf
            expected[0, 1] = float("inf")
        torch.testing.assert_close(fused.bias_act(x, None, act), expected, equal_nan=True)


def test_subnormal_results_are_kept(dev):
    """exp, its gradient and pow whose float32 results are subnormal give them, as eager does (on a GPU
    Triton's libdevice flushes them to zero unless the launch keeps them): within a subnormal ulp of float64."""
    x = torch.tensor([-88.5, -95.0, -100.0, -103.0], device=dev, requires_grad=True)
    small = torch.tensor([1e-26, 1e-27, 1e-28, 1e-29], device=dev)
    exp = fused.unary_chain(x, ["exp"])
    (grad,) = torch.autograd.grad(exp.sum(), x)
    x64 = x.detach().double()
    cases = {
        "exp": (exp, x64.exp()),
        "exp's gradient": (grad, x64.exp()),
        "pow 1.5": (fused.unary_chain(small, [("pow", 1.5)]), small.double().pow(1.5)),
    }
    for name, (ours, exact) in cases.items():
        assert (exact < torch.finfo(torch.float32).tiny).all() and (exact > 2.0**-149).all()  # subnormal results
        err = (ours.double() - exact).abs().cpu()
        assert (err <= 2.0**-149).all(), (name, ours, exact)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_unary_chain_special_values_as_eager(dev, dtype):
    """Signed zeros, infinities, NaN and tiny values through the ops whose edges differ between C and eager: pow
    with exponent 0.5 / -0.5 is sqrt / rsqrt in eager (pow(-0, 0.5) = -0, NaN at -inf), rsqrt's derivative is
    -0.5 rsqrt(x)^3 (+inf at -0), and clamp to a NaN bound gives NaN; neg, cos' -sin and reciprocal's -(1/x)^2 keep
    the sign of a zero (Triton 3.6 lowers a unary minus to 0 - x). Values and gradients, as eager gives them."""
    x = torch.tensor([-0.0, 0.0, -math.inf, math.inf, -1.0, 4.0, math.nan, 1e-30, -2.0], dtype=dtype, device=dev)
    chains = [["rsqrt"], ["sqrt"], ["reciprocal"], ["log"], ["neg"], ["cos"]]
    chains += [[("clamp_min", 0.5)], [("clamp_max", 0.5)]]
    chains += [[("pow", e)] for e in (0.5, -0.5, 1.5, 2.0)]
    chains += [[(c, math.nan)] for c in ("clamp_min", "clamp_max")]
    for chain in chains:
        xe, xf = x.clone().requires_grad_(), x.clone().requires_grad_()
        want = ref.unary_chain(xe, chain)
        got = fused.unary_chain(xf, chain)
        assert same_values(got, want), (chain, got, want)
        assert same_values(torch.autograd.grad(got.sum(), xf)[0], torch.autograd.grad(want.sum(), xe)[0]), chain


def test_relu_gradient_at_nan_passes_as_eager(dev):
    """Eager's relu backward (threshold_backward) zeroes the gradient where the input is <= 0 only: at NaN it passes.
    bias_act, glu (the gate's derivative) and unary_chain do the same."""
    x = torch.tensor([float("nan"), 2.0, -1.0, 0.0], device=dev, requires_grad=True)
    want = torch.autograd.grad(torch.relu(x).sum(), x)[0]
    assert want.tolist() == [1.0, 1.0, 0.0, 0.0]
    for out in (
        fused.bias_act(x, None, "relu"),
        fused.unary_chain(x, ["relu"]),
        fused.glu(x, torch.ones_like(x), "relu"),
    ):
        assert torch.equal(torch.autograd.grad(out.sum(), x)[0], want)


def test_relu_and_clamps_block_non_finite_gradients_as_eager(dev):
    """Eager's relu backward (threshold_backward) and clamp backward select: an inf or NaN incoming gradient where
    the op is flat gives 0, not inf * 0 = NaN. So do bias_act, glu (an inf in up), linear_act and unary_chain."""
    x = torch.tensor([-1.0, 0.0, 2.0, -3.0, 1.0], device=dev, requires_grad=True)
    g = torch.tensor([math.inf, math.nan, 1.0, -math.inf, 2.0], device=dev)
    up = torch.tensor([math.inf, -math.inf, 1.0, math.nan, 3.0], device=dev)

    def grad(fn):
        return torch.autograd.grad(fn(x), x, g)[0]

    cases = [
        (lambda t: fused.bias_act(t, None, "relu"), torch.relu),
        (lambda t: fused.unary_chain(t, ["relu"]), torch.relu),
        (lambda t: fused.unary_chain(t, [("clamp_min", 0.5)]), lambda t: torch.clamp_min(t, 0.5)),
        (lambda t: fused.unary_chain(t, [("clamp_max", 0.5)]), lambda t: torch.clamp_max(t, 0.5)),
        (lambda t: fused.unary_chain(t, ["relu", ("mul", 2.0)]), lambda t: torch.relu(t) * 2.0),
        (lambda t: fused.linear_act(t[:, None], torch.ones(1, 1, device=dev), None, "relu")[:, 0], torch.relu),
    ]
    for ours, eager in cases:
        assert same_values(grad(ours), grad(eager))
    ones = torch.ones_like(g)
    ours = torch.autograd.grad(fused.glu(x, up, "relu"), x, ones)[0]
    assert same_values(ours, torch.autograd.grad(torch.relu(x) * up, x, ones)[0])


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(0, 9),
    cols=st.integers(1, 300),
    act=st.sampled_from(ACTS),
    transpose=st.booleans(),
    scale=st.sampled_from([1e-3, 1.0, 30.0]),
)
def test_bias_act_hypothesis_cpu(rows, cols, act, transpose, scale):
    x = make((cols, rows) if transpose else (rows, cols), seed=rows * 1000 + cols) * scale
    x = x.t() if transpose else x
    b = make((x.shape[-1],), seed=cols) * scale
    assert_close(fused.bias_act(x, b, act), ref.bias_act(x, b, act))


def test_bias_act_gradcheck_compile():
    x = make((3, 5, 11), torch.float64, requires_grad=True)
    b = make((11,), torch.float64, requires_grad=True)
    for act in ACTS:
        assert torch.autograd.gradcheck(lambda x, b: fused.bias_act(x, b, act), (x, b))
    check_compile(lambda x, b: fused.bias_act(x, b, "gelu"), x.detach().float(), b.detach().float())


def test_bias_act_errors():
    x = make((4, 8))
    with raises(r"fused\.bias_act: unknown act 'swish'"):
        fused.bias_act(x, None, "swish")
    with raises(r"fused\.bias_act: bias must be 1-D with x.size\(-1\) entries"):
        fused.bias_act(x, make((7,)))
    with raises(r"fused\.bias_act: bias has dtype torch.float64 but x has dtype torch.float32"):
        fused.bias_act(x, make((8,), torch.float64))
    with raises(r"fused\.bias_act: x must be a floating-point tensor"):
        fused.bias_act(torch.ones(4, 8, dtype=torch.int32))
    with raises(r"fused\.bias_act: x must be a floating-point tensor"):
        torch.ops.fused.bias_act(torch.ones(4, 8, dtype=torch.int64), None, "relu")
    if torch.cuda.is_available():
        with raises(r"fused\.bias_act: bias is on cuda:0 but x is on cpu"):
            fused.bias_act(x, make((8,), device="cuda"))


# ---------------------------------------------------------------- glu
@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh", "relu", "sigmoid"])
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_glu_on_chunked_halves(dev, act, dtype):
    h = make((3, 5, 262), dtype, dev, requires_grad=True)
    gate, up = h.chunk(2, dim=-1)  # non-contiguous halves, read in place
    out = fused.glu(gate, up, act)
    assert_close(out, ref.glu(gate, up, act))
    assert_accuracy(out, ref.glu(gate, up, act), ref.glu(gate.double(), up.double(), act))
    g = make(out.shape, dtype, dev, seed=3)
    (gh,) = torch.autograd.grad(out, h, g)
    (eh,) = torch.autograd.grad(ref.glu(gate, up, act), h, g)
    h64 = h.detach().double().requires_grad_()
    (rh,) = torch.autograd.grad(ref.glu(*h64.chunk(2, -1), act), h64, g.double())
    assert_accuracy(gh, eh, rh)


@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh", "relu", "sigmoid"])
def test_glu_backward_grad_up_is_grad_times_the_forward_act(dev, act):
    """grad_up = grad * act(gate) with the forward's act(gate), bit for bit (the backward computes act and act'
    together; its act must round as the forward's does, as eager's saved activation would)."""
    gate, up = make((64, 300), torch.float32, dev, requires_grad=True), make((64, 300), torch.float32, dev, seed=1)
    g = make((64, 300), torch.float32, dev, seed=2)
    (grad_up,) = torch.autograd.grad(fused.glu(gate, up.requires_grad_(), act), up, g)
    assert torch.equal(grad_up, g * fused.bias_act(gate.detach(), None, act))


def test_glu_strided_layouts_and_empty(dev):
    gate = make((40, 9), torch.float32, dev).t()  # column-major: must be copied, never mis-read
    up = make((9, 40), torch.float32, dev)
    assert_close(fused.glu(gate, up), ref.glu(gate, up))
    big = make((2, 3, 4, 20), torch.float32, dev)
    assert_close(fused.glu(big[:, 1, :, :10], big[:, 2, :, 10:]), ref.glu(big[:, 1, :, :10], big[:, 2, :, 10:]))
    e = torch.empty(0, 4, device=dev)
    assert fused.glu(e, e).shape == (0, 4)


def test_glu_gradcheck_compile_errors():
    h = make((3, 14), torch.float64, requires_grad=True)
    for act in ACTS:
        assert torch.autograd.gradcheck(lambda h: fused.glu(*h.chunk(2, -1), act), (h,))
    gate, up = make((4, 6)), make((4, 6), seed=5)
    check_compile(lambda a, b: fused.glu(a, b, "silu"), gate, up)
    with raises(r"fused\.glu: gate and up must have the same shape"):
        fused.glu(gate, make((4, 5)))
    with raises(r"fused\.glu: unknown act 'swiglu'"):
        fused.glu(gate, up, "swiglu")
    with raises(r"fused\.glu: up has dtype torch.float16 but gate has dtype torch.float32"):
        fused.glu(gate, up.half())


# ---------------------------------------------------------------- bias_dropout_add
def _seeded(seed):
    torch.manual_seed(seed)
    return torch.randint(-(2**63), 2**63 - 1, (), dtype=torch.int64).item()


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 1.0])
def test_bias_dropout_add_mask_and_values(dev, dtype, p):
    x, r = make((3, 5, 131), dtype, dev), make((3, 5, 131), dtype, dev, seed=7)
    b = make((131,), dtype, dev)
    torch.manual_seed(123)
    out = fused.bias_dropout_add(x, b, r, p)
    expected = ref.bias_dropout_add(x, b, r, p, seed=_seeded(123))
    assert_close(out, expected)


def test_bias_dropout_add_reproducible_statistics_and_eval(dev):
    x = make((256, 1000), torch.float32, dev)
    r = torch.zeros_like(x)
    torch.manual_seed(0)
    a = fused.bias_dropout_add(x, None, r, 0.3)
    torch.manual_seed(0)
    assert torch.equal(a, fused.bias_dropout_add(x, None, r, 0.3))
    assert not torch.equal(a, fused.bias_dropout_add(x, None, r, 0.3))  # next draw, new mask
    kept = (a != 0).double().mean().item()
    assert abs(kept - 0.7) < 0.005  # 256k draws: 5 sigma ~ 0.0045
    b = make((1000,), torch.float32, dev)
    assert_close(fused.bias_dropout_add(x, b, x, 0.3, training=False), x + b + x)


def test_bias_dropout_add_backward_regenerates_mask(dev):
    x = make((33, 70), torch.float32, dev, requires_grad=True)
    b = make((70,), torch.float32, dev, requires_grad=True)
    r = make((33, 70), torch.float32, dev, requires_grad=True)
    g = make((33, 70), torch.float32, dev, seed=9)
    torch.manual_seed(5)
    out = fused.bias_dropout_add(x, b, r, 0.25)
    gx, gb, gr = torch.autograd.grad(out, (x, b, r), g)
    keep = ref.dropout_keep_mask(_seeded(5), x.shape, 0.25).to(dev)
    assert_close(gx, torch.where(keep, g / 0.75, 0.0))
    assert_close(gb, torch.where(keep, g / 0.75, 0.0).sum(0), scale=4)
    assert torch.equal(gr, g)


def test_bias_dropout_add_gradcheck_compile_errors():
    x = make((4, 6), torch.float64, requires_grad=True)
    b = make((6,), torch.float64, requires_grad=True)
    r = make((4, 6), torch.float64, requires_grad=True)
    seed = torch.tensor(1234)
    assert torch.autograd.gradcheck(
        lambda x, b, r: torch.ops.fused.bias_dropout_add_seeded(x, b, r, 0.4, seed), (x, b, r)
    )

    # Inductor draws the seed with its own RNG unless told to fall back to eager's.
    xf, bf, rf = x.detach().float(), b.detach().float(), r.detach().float()
    with torch._inductor.config.patch(fallback_random=True):
        torch._dynamo.reset()
        compiled = torch.compile(lambda x, b, r: fused.bias_dropout_add(x, b, r, 0.5), fullgraph=True)
        torch.manual_seed(3)
        got = compiled(xf, bf, rf)
    torch.manual_seed(3)
    torch.testing.assert_close(got, fused.bias_dropout_add(xf, bf, rf, 0.5))
    with raises(r"fused\.bias_dropout_add: p must be in \[0, 1\]"):
        fused.bias_dropout_add(xf, bf, rf, 1.5)
    with raises(r"fused\.bias_dropout_add: residual shape"):
        fused.bias_dropout_add(xf, bf, rf[:2])


# ---------------------------------------------------------------- unary_chain
@pytest.mark.parametrize("chain", CHAINS, ids=lambda c: "-".join(o if isinstance(o, str) else o[0] for o in c))
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_unary_chain_matches_reference(dev, chain, dtype):
    low, high = (0.99, 1.01) if chain == ["square"] * 10 else (0.5, 1.5)  # x ** 1024 stays finite
    x = make((3, 5, 131), dtype, dev, low=low, high=high)
    out = fused.unary_chain(x, chain)
    eager = ref.unary_chain(x, chain)
    assert_accuracy(out, eager, ref.unary_chain(x.double(), chain), slack=2.0)
    xg = x.detach().requires_grad_()
    g = make(x.shape, dtype, dev, seed=4)
    (gx,) = torch.autograd.grad(fused.unary_chain(xg, chain), xg, g)
    (ex,) = torch.autograd.grad(ref.unary_chain(xg, chain), xg, g)
    x64 = x.detach().double().requires_grad_()
    (rx,) = torch.autograd.grad(ref.unary_chain(x64, chain), x64, g.double())
    assert_accuracy(gx, ex, rx, slack=2.0)


# Chains of arithmetic ops only, whose CPU backward keeps the group in registers and dispatches once per run of
# equal ops (the same op and scalar): run boundaries by scalar, by op, runs of one, a last run longer than one.
INLINE_CHAINS = [
    [("add", 0.5), ("add", 0.5), ("add", 0.25), "square", "square"],
    ["square", "square", "neg", "abs", "abs", ("mul", 1.5)],
    [("clamp_min", 0.1), "sqrt", "sqrt", "rsqrt", "reciprocal", "reciprocal", ("clamp_max", 3.0), ("clamp_max", 3.0)],
    ["relu"],
]


@pytest.mark.parametrize("chain", INLINE_CHAINS, ids=lambda c: "-".join(o if isinstance(o, str) else o[0] for o in c))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_unary_chain_backward_of_runs(chain, dtype):
    x = make((3, 5, 131), dtype, low=-1.5, high=1.5)  # groups of 8 vectors and a tail in every block
    g = make(x.shape, dtype, seed=6)
    ours = torch.ops.fused.unary_chain_backward(g, x, fused.elementwise.encode_ops(chain))
    xg = x.detach().requires_grad_()
    (eager,) = torch.autograd.grad(ref.unary_chain(xg, chain), xg, g)
    x64 = x.detach().double().requires_grad_()
    (ref64,) = torch.autograd.grad(ref.unary_chain(x64, chain), x64, g.double())
    assert ours.dtype == dtype
    assert_accuracy(ours, eager, ref64, slack=2.0)


@pytest.mark.parametrize("chain", INLINE_CHAINS, ids=lambda c: "-".join(o if isinstance(o, str) else o[0] for o in c))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_unary_chain_forward_of_runs(chain, dtype):
    """The forward of chains of inline ops, one dispatch per run of equal ops: the same run boundaries."""
    x = make((3, 5, 131), dtype, low=-1.5, high=1.5)
    ours = fused.unary_chain(x, chain)
    assert ours.dtype == dtype
    assert_accuracy(ours, ref.unary_chain(x, chain), ref.unary_chain(x.double(), chain), slack=2.0)


def test_unary_chain_long_noncontiguous_empty(dev):
    x = noncontiguous(make((50, 30), torch.float32, dev, low=-1, high=1))
    chain = [("mul", 0.9), "sin"] * 40  # 80 ops: two launches of the CUDA C++ kernel
    assert_close(fused.unary_chain(x, chain), ref.unary_chain(x, chain), scale=4)
    xg, g = x.detach().requires_grad_(), make(x.shape, torch.float32, dev, seed=5)
    (ours,) = torch.autograd.grad(fused.unary_chain(xg, chain), xg, g)
    (theirs,) = torch.autograd.grad(ref.unary_chain(xg, chain), xg, g)
    assert_close(ours, theirs, scale=4)
    assert fused.unary_chain(torch.empty(0, 3, device=dev), ["exp"]).shape == (0, 3)
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -1.0], device=dev)
    for chain in (["exp"], ["log"], ["sqrt"], ["reciprocal"], [("clamp_min", 0.0)], ["relu", "tanh"]):
        torch.testing.assert_close(fused.unary_chain(special, chain), ref.unary_chain(special, chain), equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_chain_in_pieces_equals_one_pass(dtype):
    """The split the CUDA C++ backend uses for chains longer than one launch takes, driven by the CPU kernels
    with 3 ops per piece: the same values and gradients as one pass (float32 kept between 16-bit pieces)."""
    from fused.elementwise.ops import chain_in_pieces

    forward, backward = chain_in_pieces(torch.ops.fused.unary_chain, torch.ops.fused.unary_chain_backward, 3)
    chain = fused.elementwise.encode_ops(
        [("mul", 1.5), "sin", "square", ("add", -0.25), "tanh", "exp", "silu", ("pow", 2.0), "cos", "sigmoid", "gelu"]
    )  # 11 ops: 4 pieces
    x, g = make((3, 5, 131), dtype, low=-2, high=2), make((3, 5, 131), dtype, seed=1)
    one_pass = torch.ops.fused.unary_chain(x, chain)
    assert torch.equal(forward(x, chain), one_pass)  # float32 between pieces: the bits of one pass
    # the backward multiplies the pieces' derivatives in another order: equal up to rounding
    assert_close(backward(g, x, chain), torch.ops.fused.unary_chain_backward(g, x, chain), scale=1)
    assert forward(x, chain).dtype == dtype
    assert torch.equal(forward(x, chain[:3]), torch.ops.fused.unary_chain(x, chain[:3]))  # one piece: one call


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(0, 3000),
    chain=st.lists(
        st.sampled_from(
            [
                "neg",
                "abs",
                "square",
                "sin",
                "cos",
                "tanh",
                "sigmoid",
                "relu",
                "gelu",
                "silu",
                ("mul", 0.75),
                ("add", -0.5),
                ("clamp_min", -1.0),
                ("clamp_max", 1.0),
            ]
        ),
        min_size=1,
        max_size=12,
    ),
)
def test_unary_chain_hypothesis_cpu(n, chain):
    # Chains like square, square, silu, square, sin amplify a one-ulp difference in one op to 1e-4, so the
    # measure is the error against float64, no worse than eager's (not closeness to eager element by element).
    # Floor: 16 ulps. Below one vector (n < 16) eager computes with libm while every kernel of ours uses
    # at::vec's functions (as eager does on larger tensors): gelu's vector erf near x = -2 is ~6 ulps off.
    x = make((n,), seed=n, low=-2, high=2)
    assert_accuracy(
        fused.unary_chain(x, chain),
        ref.unary_chain(x, chain),
        ref.unary_chain(x.double(), chain),
        floor=16 * torch.finfo(torch.float32).eps,
    )


def test_unary_chain_gradcheck_compile_errors():
    x = make((4, 7), torch.float64, low=0.5, high=2.0, requires_grad=True)
    for chain in CHAINS:
        assert torch.autograd.gradcheck(lambda x: fused.unary_chain(x, chain), (x,))
    xf = x.detach().float()
    check_compile(lambda x: fused.unary_chain(x, [("mul", 0.5), "tanh", ("add", 1.0)]), xf)
    with raises(r"fused\.unary_chain: unknown op 'cosh'"):
        fused.unary_chain(xf, ["cos", "cosh"])
    with raises(r"fused\.unary_chain: op 'mul' needs a scalar"):
        fused.unary_chain(xf, ["mul"])
    with raises(r"fused\.unary_chain: op 'exp' takes no scalar"):
        fused.unary_chain(xf, [("exp", 2.0)])
    with raises(r"fused\.unary_chain: ops must be a sequence"):
        fused.unary_chain(xf, "exp")
    with raises(r"fused\.unary_chain: unknown op 'cosh'"):
        torch.ops.fused.unary_chain(xf, ["cosh"])


def test_dropout_refuses_cuda_graph_capture(monkeypatch):
    """A captured graph would replay the host-drawn seed, one mask forever: training dropout refuses capture, and
    eval mode (or p = 0) captures. The capture state is stood in for here; on a GPU the real capture is tried."""
    x = make((4, 8))
    if torch.cuda.is_available():
        xc = x.cuda()
        graph = torch.cuda.CUDAGraph()
        with raises(r"fused\.bias_dropout_add: training=True with p > 0 cannot be captured in a CUDA graph"):
            with torch.cuda.graph(graph):
                fused.bias_dropout_add(xc, None, xc, p=0.1, training=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with raises(r"fused\.bias_dropout_add: training=True with p > 0 cannot be captured in a CUDA graph"):
        fused.bias_dropout_add(x, None, x, p=0.1, training=True)
    assert torch.equal(fused.bias_dropout_add(x, None, x, p=0.1, training=False), x + x)
    assert torch.equal(fused.bias_dropout_add(x, None, x, p=0.0, training=True), x + x)
