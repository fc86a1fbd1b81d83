"""Parity, accuracy, determinism, compile and bad-input tests of the norm family (rms_norm, layer_norm and the fused
add variants; CPU kernels, and the CUDA backends when a GPU is present), the nn modules, and two real clients: a
GPT-2 style block with FusedLayerNorm and a Llama style block with FusedRMSNorm, residual adds fused. The Triton
launchers have their own file under the interpreter.

Ported cases: from torch's test_nn.py, _test_LayerNorm_general (mean 0 / variance 1 with eps=0, then the affine
scale and shift, over random shapes and normalized dims; its table of bad normalized_shape / input pairs),
test_LayerNorm_numeric (a normalized row of 256*256*144 elements, here 16*64*144 = 147456, against the mean / var
formula), _test_module_empty_input (zero gradients for an empty batch) and _test_LayerNorm_cuda_half (the output
dtype); from torch's OpInfo samples for layer_norm / rms_norm, the (input, normalized_shape, eps) cases, negative
eps and an empty batch included; from torch's module tests (module_inputs_torch_nn_RMSNorm / _LayerNorm), every
constructor / input pair, the parameters' .grad after backward compared. From Liger-Kernel: test_rms_norm's and
test_fused_add_rms_norm's shapes (2x128x512 and the odd 3x423x213, 5x123x123) against the Llama-style (hidden +
residual, float32 upcast) reference with Liger's tolerances, and test_layer_norm's shapes (1x1x1023, 3x7x256)
against nn.LayerNorm."""

import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fused
from fused.norm import reference as ref
from tests.harness import (
    ALL_DTYPES,
    SEEDS,
    assert_accuracy,
    assert_accuracy_over_seeds,
    assert_close,
    check_compile,
    ignore_torch_jit_deprecation,
    make,
    noncontiguous,
    raises,
    requires_cuda,
)

OPS = ["rms_norm", "layer_norm", "add_rms_norm", "add_layer_norm"]


def call(op, x, residual, ns, weight, bias, eps="default", impl=fused, **kw):
    """op through `impl` (fused or the reference module) with the arguments it takes; a tuple out for every op."""
    fn = getattr(impl, op)
    args = [x] + ([residual] if op.startswith("add_") else []) + [ns, weight]
    if "layer" in op:
        args.append(bias)
    if eps != "default":
        args.append(eps)
    out = fn(*args, **kw)
    return out if isinstance(out, tuple) else (out,)


def inputs(op, shape, ns, dtype, dev, param_dtype=None, affine=True, requires_grad=True):
    param_dtype = param_dtype or dtype
    x = make(shape, dtype, dev, requires_grad=requires_grad, seed=1)
    r = make(shape, dtype, dev, requires_grad=requires_grad, seed=2)
    w = make(ns, param_dtype, dev, 0.5, 1.5, requires_grad=requires_grad, seed=3) if affine else None
    b = make(ns, param_dtype, dev, requires_grad=requires_grad, seed=4) if affine and "layer" in op else None
    return x, r, w, b


def grads_of(op, impl, x, r, ns, w, b, grads, eps="default"):
    """The outputs and the gradients of every differentiable input, for output gradients `grads`."""
    leaves = [t for t in (x, r if op.startswith("add_") else None, w, b) if t is not None]
    outs = call(op, x, r, ns, w, b, eps, impl)
    return outs, torch.autograd.grad(outs, leaves, grads[: len(outs)])


def float64_copy(*ts):
    return [t.detach().double().requires_grad_() if t is not None else None for t in ts]


def check_against_float64(op, x, r, ns, w, b, eps="default", slack=2.0):
    """Our outputs and gradients vs eager's, both judged against a float64 run (error no worse than eager's x2)."""
    g = [make(x.shape, x.dtype, x.device, seed=5), make(x.shape, x.dtype, x.device, seed=6)]
    outs, grads = grads_of(op, fused, x, r, ns, w, b, g, eps)
    eager_outs, eager_grads = grads_of(op, ref, x, r, ns, w, b, g, eps)
    x64, r64, w64, b64 = float64_copy(x, r, w, b)
    if op.startswith("add_"):  # the sum rounds to the stream's dtype in both; the float64 run starts from it
        h = (x + r).detach().double()
        ref_outs, ref_grads = grads_of(op[4:], ref, h.requires_grad_(), None, ns, w64, b64, g, eps)
        ref_outs = ref_outs + (h,)
        ref_grads = (ref_grads[0] + g[1].double(),) * 2 + ref_grads[1:]
    else:
        ref_outs, ref_grads = grads_of(op, ref, x64, r64, ns, w64, b64, g, eps)
    for ours, eager, exact in zip(outs + grads, eager_outs + eager_grads, ref_outs + ref_grads):
        assert ours.dtype == eager.dtype and ours.shape == eager.shape
        assert_accuracy(ours, eager, exact, slack)
    return outs, grads


# ---------------------------------------------------------------- forward and gradients against float64
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("shape,ns", [((3, 5, 131), (131,)), ((4, 5, 24), (5, 24))])
def test_outputs_and_gradients_against_float64(dev, op, dtype, shape, ns):
    x, r, w, b = inputs(op, shape, ns, dtype, dev)
    outs, _ = check_against_float64(op, x, r, ns, w, b)
    assert_close(outs[0], call(op, x, r, ns, w, b, impl=ref)[0])
    if op.startswith("add_"):
        assert torch.equal(outs[1], x + r)  # the sum's bits are eager's


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_float32_weight_and_no_weight(dev, op, dtype):
    """Weight (and bias) in float32 with 16-bit activations, as torch allows, and no affine parameters at all."""
    x, r, w, b = inputs(op, (6, 200), (200,), dtype, dev, param_dtype=torch.float32)
    outs, grads = check_against_float64(op, x, r, (200,), w, b)
    assert outs[0].dtype == dtype and grads[-1].dtype == torch.float32
    x, r, _, _ = inputs(op, (6, 200), (200,), dtype, dev)
    check_against_float64(op, x, r, (200,), None, None)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("C", [1, 2, 65536])
def test_tiny_and_huge_rows(dev, op, dtype, C):
    rows = 3 if C == 65536 else 40
    x, r, w, b = inputs(op, (rows, C), (C,), dtype, dev)
    check_against_float64(op, x, r, (C,), w, b)


@pytest.mark.parametrize("op", OPS)
def test_rows_of_zeros(dev, op):
    """rms of 0: x * 1/sqrt(eps) = 0; layer norm of a constant row: bias. Gradients finite, as eager's."""
    x, r, w, b = inputs(op, (4, 64), (64,), torch.float32, dev)
    with torch.no_grad():
        x[1:3] = 0
        r[1:3] = 0
        x[3] = 2.5
        r[3] = -0.5
    outs, grads = check_against_float64(op, x, r, (64,), w, b)
    expected = torch.zeros(64, device=dev) if b is None else b.detach()
    assert torch.equal(outs[0][1], expected) and torch.equal(outs[0][2], expected)
    assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("op", OPS)
def test_nan_inf_propagate_like_eager(dev, op):
    x, r, w, b = inputs(op, (5, 16), (16,), torch.float32, dev, requires_grad=False)
    x[0, 3], x[1, 5], x[2, 0], x[2, 1] = float("nan"), float("inf"), float("inf"), -float("inf")
    x[3, 7] = 1e30  # its square overflows float32: rstd 0, as in eager on the CPU
    outs = call(op, x, r, (16,), w, b)
    # Eager on the CPU is the expectation on every device: what an overflowing row gives depends on how a kernel
    # combines its partial statistics (torch's CUDA Welford combine may meet inf * 0), and ours keep the CPU's rstd 0.
    cpu = [t.cpu() if t is not None else None for t in (x, r, w, b)]
    expected = call(op, *cpu[:2], (16,), *cpu[2:], impl=ref)
    for o, e in zip(outs, expected):
        torch.testing.assert_close(o.cpu(), e, equal_nan=True)
    assert torch.isnan(outs[0][0]).all() and torch.isfinite(outs[0][4]).all()


def test_eps_default_and_explicit(dev):
    """eps=None is torch's: float32's epsilon for 16-bit and float32 x (it dominates for tiny rows)."""
    x = torch.full((2, 8), 1e-3, dtype=torch.bfloat16, device=dev)
    assert torch.equal(fused.rms_norm(x, (8,)), F.rms_norm(x, (8,)))
    xf = make((3, 8), torch.float64, dev) * 1e-9
    assert_close(fused.rms_norm(xf, (8,)), F.rms_norm(xf, (8,)))
    assert_close(fused.rms_norm(xf, (8,), eps=0.5), F.rms_norm(xf, (8,), eps=0.5))
    assert_close(fused.layer_norm(xf, (8,), eps=0.25), F.layer_norm(xf, (8,), eps=0.25))


def test_residual_float32_stream_with_16bit_activations(dev):
    """residual_dtype=float32 (or a float32 residual): the sum is float32, the norm bf16; gradients in each
    input's dtype. The first block of such a stream gets a bf16 residual and widens it."""
    x, r, w, b = inputs("add_layer_norm", (7, 96), (96,), torch.bfloat16, dev)
    out, h = fused.add_layer_norm(x, r, (96,), w, b, residual_dtype=torch.float32)
    assert out.dtype == torch.bfloat16 and h.dtype == torch.float32
    assert torch.equal(h, x.float() + r.float())
    expected_out, expected_h = ref.add_layer_norm(x, r, (96,), w, b, residual_dtype=torch.float32)
    assert torch.equal(h, expected_h)
    assert_close(out, expected_out)
    r32 = h.detach().requires_grad_()
    out2, h2 = fused.add_rms_norm(x, r32, (96,), w)
    assert h2.dtype == torch.float32 and out2.dtype == torch.bfloat16
    g, gh = make(out2.shape, torch.bfloat16, dev, seed=7), make(out2.shape, torch.float32, dev, seed=8)
    gx, gr, gw = torch.autograd.grad((out2, h2), (x, r32, w), (g, gh))
    assert (gx.dtype, gr.dtype, gw.dtype) == (torch.bfloat16, torch.float32, torch.bfloat16)
    x64, r64, w64 = float64_copy(x, r32, w)
    h64 = x64 + r64
    ex = torch.autograd.grad((F.rms_norm(h64, (96,), w64), h64), (x64, r64, w64), (g.double(), gh.double()))
    e_out, e_h = ref.add_rms_norm(x, r32, (96,), w)
    eager = torch.autograd.grad((e_out, e_h), (x, r32, w), (g, gh))
    for ours, eag, exact in zip((gx, gr, gw), eager, ex):
        assert_accuracy(ours, eag, exact)


# ---------------------------------------------------------------- determinism
@pytest.mark.parametrize("op", ["add_rms_norm", "add_layer_norm"])
def test_gradients_bit_identical_across_runs_and_thread_counts(dev, op):
    """Weight and bias gradients are per-chunk sums in fixed slots, chunks fixed by the shape alone: the same
    bits on every run, and on the CPU for 1, 2 or 3 threads (2100 rows: many chunks)."""
    x, r, w, b = inputs(op, (2100, 96), (96,), torch.float32, dev)
    g = [make(x.shape, device=dev, seed=5), make(x.shape, device=dev, seed=6)]
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2, 3, 2):
            torch.set_num_threads(n)
            results.append(grads_of(op, fused, x, r, (96,), w, b, g)[1])
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:
        for a, c in zip(results[0], other):
            assert torch.equal(a, c)


# ---------------------------------------------------------------- layouts, empty, meta
@pytest.mark.parametrize("op", OPS)
def test_noncontiguous_inputs(dev, op):
    x, r, w, b = inputs(op, (6, 40), (40,), torch.float32, dev)
    xs, rs, ws = noncontiguous(x), noncontiguous(r).t().contiguous().t(), noncontiguous(w)
    assert not xs.is_contiguous() and not rs.is_contiguous() and not ws.is_contiguous()
    check_against_float64(op, xs, rs, (40,), ws, noncontiguous(b) if b is not None else None)
    xt = make((40, 6), torch.float32, dev, seed=3).t()  # transposed: must be copied, never misread
    assert_close(call(op, xt, xt * 2, (40,), w, b)[0], call(op, xt, xt * 2, (40,), w, b, impl=ref)[0])


@pytest.mark.parametrize("op", OPS)
def test_empty_batch_gives_zero_parameter_gradients(dev, op):
    """As torch's _test_module_empty_input: outputs of the input's shape, zero gradients everywhere."""
    x, r, w, b = inputs(op, (0, 3, 10), (10,), torch.float32, dev)
    outs = call(op, x, r, (10,), w, b)
    assert outs[0].shape == (0, 3, 10)
    grads = torch.autograd.grad(
        outs,
        [t for t in (x, r, w, b) if t is not None and (t is not r or "add" in op)],
        [torch.rand_like(o) for o in outs],
    )
    for grad in grads:
        assert torch.equal(grad, torch.zeros_like(grad))


def test_meta_tensors_get_shapes_from_the_fake_kernels():
    x = torch.empty(2, 3, 8, device="meta", dtype=torch.bfloat16)
    w = torch.empty(8, device="meta")
    assert fused.rms_norm(x, 8, w).shape == (2, 3, 8)
    out, h = fused.add_layer_norm(x, x, (3, 8), residual_dtype=torch.float32)
    assert out.dtype == torch.bfloat16 and h.dtype == torch.float32 and h.device.type == "meta"
    with raises(r"fused\.rms_norm: weight must have shape normalized_shape \(8,\), got \(7,\)"):
        fused.rms_norm(x, 8, torch.empty(7, device="meta"))


# ---------------------------------------------------------------- torch.autocast
def _autocast_cases(device):
    x = make((4, 6, 32), torch.bfloat16, device=device, seed=3)
    w, b = make((32,), torch.float32, device=device, seed=4), make((32,), torch.float32, device=device, seed=5)
    return (
        x,
        [
            ("rms_norm", lambda t, w, b: fused.rms_norm(t, 32, w), lambda t, w, b: F.rms_norm(t, (32,), w)),
            ("layer_norm", lambda t, w, b: fused.layer_norm(t, 32, w, b), lambda t, w, b: F.layer_norm(t, (32,), w, b)),
            ("torch.ops", lambda t, w, b: torch.ops.fused.layer_norm(t, [32], w, b), None),
        ],
        w,
        b,
    )


def test_autocast_float32_policy(monkeypatch):
    """Under CUDA autocast torch runs F.layer_norm and F.rms_norm in float32 (aten's autocast fp32 list), and so do
    the fused norms; CPU autocast leaves both in the input's dtype. The CUDA rule's cast, run here on the CPU: the
    float32 result of the float32 inputs, gradients in the inputs' dtypes."""
    x, cases, w, b = _autocast_cases("cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for name, ours, torchs in cases:
            assert ours(x, w, b).dtype == torch.bfloat16, name
            if torchs:
                assert torchs(x, w, b).dtype == torch.bfloat16, name
    monkeypatch.setitem(fused._autocast.FLOAT32_DEVICES, "norm", ("cpu", "cuda"))
    x.requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for name, ours, _ in cases:
            out = ours(x, w, b)
            assert out.dtype == torch.float32, name
            assert torch.equal(out, ours(x.detach().float(), w, b)), name
            assert torch.autograd.grad(out.sum(), x)[0].dtype == torch.bfloat16, name


@requires_cuda
def test_autocast_on_cuda_as_torch():
    x, cases, w, b = _autocast_cases("cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        for name, ours, torchs in cases:
            out = ours(x, w, b)
            assert out.dtype == torch.float32, name
            if torchs:
                assert torchs(x, w, b).dtype == torch.float32, name


# ---------------------------------------------------------------- bad input
def test_errors_name_the_op_and_argument():
    x, w = make((4, 8)), make((8,))
    with raises(r"fused\.rms_norm: weight must have shape normalized_shape \[8\], got \[7\]"):
        fused.rms_norm(x, 8, make((7,)))
    with raises(r"fused\.layer_norm: bias must have shape normalized_shape \[8\], got \[2, 4\]"):
        fused.layer_norm(x, 8, w, make((2, 4)))
    with raises(r"fused\.layer_norm: x of shape \[4, 8\] does not end with normalized_shape \[4\]"):
        fused.layer_norm(x, 4)
    with raises(r"fused\.add_rms_norm: residual shape \[4, 7\] does not match x shape \[4, 8\]"):
        fused.add_rms_norm(x, make((4, 7)), 8)
    with raises(r"fused\.add_layer_norm: residual has dtype torch.float16 but x has dtype torch.float32"):
        fused.add_layer_norm(x, x.half(), 8)
    with raises(r"fused\.add_rms_norm: residual_dtype torch.float64 but x has dtype torch.float32"):
        fused.add_rms_norm(x, x, 8, residual_dtype=torch.float64)
    with raises(r"fused\.add_rms_norm: residual has dtype torch.float32, neither x's \(torch.bfloat16\)"):
        fused.add_rms_norm(x.bfloat16(), x, 8, residual_dtype=torch.bfloat16)
    with raises(r"fused\.rms_norm: x must be a floating-point tensor, got torch.int32"):
        fused.rms_norm(torch.ones(4, 8, dtype=torch.int32), 8)
    with raises(r"fused\.rms_norm: weight must be a floating-point tensor"):
        fused.rms_norm(x, 8, torch.ones(8, dtype=torch.int64))
    with raises(r"fused\.layer_norm: weight is on meta but x is on cpu"):
        fused.layer_norm(x, 8, torch.empty(8, device="meta"))
    with raises(r"fused\.add_layer_norm: residual is on meta but x is on cpu"):
        fused.add_layer_norm(x, torch.empty(4, 8, device="meta"), 8)
    if torch.cuda.is_available():
        with raises(r"fused\.rms_norm: weight is on cuda:0 but x is on cpu"):
            fused.rms_norm(x, 8, w.cuda())


@pytest.mark.parametrize("rows, C", [(20000, 16), (2048, 1024)])
@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
def test_parameter_gradients_over_many_rows_as_accurate_as_eager(op, rows, C):
    """The weight (and bias) gradients sum a column over every row: pairwise within chunks, not in long float32
    runs, which were 2.4-4x eager's error against float64 at small widths. Judged over seeds: one set of C sums
    moves with the machine's summation order (eager's too)."""
    torch_fn = {"rms_norm": F.rms_norm, "layer_norm": F.layer_norm}[op]
    samples = []  # per seed: (ours, eager, float64) of each parameter's gradient
    for seed in range(SEEDS):
        x, g = make((rows, C), seed=10 * seed + 8), make((rows, C), seed=10 * seed + 9)
        params = [make((C,), seed=10 * seed + k, requires_grad=True) for k in range(2 if "layer" in op else 1)]
        ours = torch.autograd.grad(getattr(fused, op)(x, (C,), *params), params, g)
        eager = torch.autograd.grad(torch_fn(x, (C,), *params), params, g)
        p64 = [p.detach().double().requires_grad_() for p in params]
        want = torch.autograd.grad(torch_fn(x.double(), (C,), *p64), p64, g.double())
        samples.append(list(zip(ours, eager, want)))
    for per_param in zip(*samples):
        assert_accuracy_over_seeds(list(per_param))


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
def test_bad_normalized_shapes_from_torch(op):
    """torch's _test_LayerNorm_general table of normalized_shape / input shape pairs that must fail."""
    bad = {(): (), (2, 3): (3,), (2,): (1, 2, 3), (10,): (2, 3), 10: (2, 3)}
    for ns, shape in bad.items():
        with raises(rf"fused\.{op}: (normalized_shape must have at least one dimension|x of shape)"):
            getattr(fused, op)(torch.rand(shape) * 10, ns)
    for ns in (8.0, torch.tensor(8), "8"):
        with raises(rf"fused\.{op}: normalized_shape must be an int or a sequence of ints"):
            getattr(fused, op)(torch.rand(2, 8), ns)


# ---------------------------------------------------------------- torch's and Liger's cases
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_norm_general_from_torch(dtype):
    """Normalises to mean 0, variance 1 with eps=0 over 1..i-1 trailing dims, then applies scale and shift."""
    rnd = random.Random(0)
    for i in range(2, 6):
        shape = [rnd.randint(3, 5) for _ in range(i)]
        x = (torch.rand(shape, generator=torch.Generator().manual_seed(i)) * 10).to(dtype)
        k = rnd.randint(1, i - 1)
        ns, lead = shape[-k:], shape[:-k]
        ln = fused.nn.FusedLayerNorm(ns, eps=0).to(dtype)
        out = ln(x).view(*lead, -1).float()
        delta = 1e-1 if dtype == torch.bfloat16 else 1e-5
        assert out.mean(-1).abs().mean().item() == pytest.approx(0, abs=delta)
        assert out.var(-1, unbiased=False).abs().mean().item() == pytest.approx(1, abs=delta)
        scale, shift = rnd.uniform(0.2, 2), rnd.uniform(0.2, 2)
        ln.weight.data.fill_(scale)
        ln.bias.data.fill_(shift)
        out = ln(x).view(*lead, -1).float()
        assert out.mean(-1).abs().mean().item() == pytest.approx(shift, abs=delta)
        assert out.var(-1, unbiased=False).abs().mean().item() == pytest.approx(scale**2, abs=delta * 4)


def test_layer_norm_numeric_from_torch():
    """A 147456-element normalized row against the mean / biased-var formula (atol 1e-5, as torch's test)."""
    ns = [16, 64, 144]
    ln = fused.nn.FusedLayerNorm(ns)
    x = torch.rand(2, *ns, generator=torch.Generator().manual_seed(0))
    view = x.view(2, -1)
    expected = (
        (view - view.mean(-1, keepdim=True)) / torch.sqrt(view.var(-1, unbiased=False, keepdim=True) + ln.eps)
    ).view_as(x)
    torch.testing.assert_close(ln(x), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
def test_opinfo_samples_from_torch(dev, op):
    """torch's OpInfo samples: (input, normalized_shape, eps), negative eps and an empty batch included."""
    cases = [
        ((1, 2, 3), (1, 2, 3), 0.5),
        ((2, 2, 3), (2, 3), -0.5),
        ((1,), (1,), 1e-5),
        ((1, 2), (2,), 1e-5),
        ((0, 1), (1,), 1e-5),
    ]
    for shape, ns, eps in cases:
        x, r, w, b = inputs(op, shape, ns, torch.float64, dev)
        for weight, bias in ((w, b), (None, None)):
            for ours, expected in zip(
                call(op, x, r, ns, weight, bias, eps), call(op, x, r, ns, weight, bias, eps, impl=ref)
            ):
                torch.testing.assert_close(ours, expected, equal_nan=True)


# torch's module_inputs_torch_nn_RMSNorm / _LayerNorm: (normalized_shape, eps, elementwise_affine, input shape)
MODULE_CASES = [
    ([5], 1e-3, True, (4, 5, 5)),
    ([5], 1e-3, True, (128, 5, 5)),
    ([5], 1e-3, False, (4, 5, 5)),
    ([2, 2, 5], 1e-3, True, (4, 2, 2, 5)),
    ([2, 2, 5], 1e-3, False, (4, 2, 2, 5)),
    ([5], 1e-3, True, (0, 5)),
]


@pytest.mark.parametrize("kind", ["rms", "layer", "layer_no_bias"])
@pytest.mark.parametrize("case", MODULE_CASES)
def test_module_inputs_from_torch(dev, kind, case):
    """Each of torch's module test inputs through our module and torch's with the same parameters: outputs, the
    input's gradient and every parameter's .grad after backward."""
    ns, eps, affine, shape = case
    if kind == "rms":
        theirs, ours = nn.RMSNorm(ns, eps, affine, device=dev), fused.nn.FusedRMSNorm(ns, eps, affine, device=dev)
    else:
        kw = {"bias": kind == "layer", "device": dev}
        theirs, ours = nn.LayerNorm(ns, eps, affine, **kw), fused.nn.FusedLayerNorm(ns, eps, affine, **kw)
    with torch.no_grad():
        for p in theirs.parameters():
            p.uniform_(0.5, 1.5)
    ours.load_state_dict(theirs.state_dict())
    x = make(shape, torch.float64, dev, requires_grad=True)
    theirs, ours = theirs.double(), ours.double()
    x2 = x.detach().clone().requires_grad_()
    g = make(shape, torch.float64, dev, seed=3)
    theirs(x).backward(g)
    ours(x2).backward(g)
    assert_close(ours(x2), theirs(x))
    assert_close(x2.grad, x.grad)
    for a, e in zip(ours.parameters(), theirs.parameters()):
        assert_close(a.grad, e.grad)


class LlamaAddRMSNorm(nn.Module):
    """Liger's test reference: hidden + residual, float32 statistics, weight applied in the input dtype."""

    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden, residual):
        hidden = hidden + residual
        residual = hidden
        dtype = hidden.dtype
        h = hidden.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(dtype), residual


@pytest.mark.parametrize("shape", [(2, 128, 512), (3, 423, 213), (5, 123, 123)])
@pytest.mark.parametrize("dtype,atol,rtol", [(torch.float32, 1e-4, 1e-6), (torch.bfloat16, 2e-1, 2e-2)])
def test_liger_fused_add_rms_norm_cases(shape, dtype, atol, rtol):
    torch.manual_seed(42)
    x, r = torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)
    dh, dr = torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)
    reference = LlamaAddRMSNorm(shape[-1]).to(dtype)
    ours = fused.nn.FusedRMSNorm(shape[-1], eps=1e-6).to(dtype)
    x1, r1, x2, r2 = (t.clone().requires_grad_() for t in (x, r, x, r))
    ref_out, ref_res = reference(x1, r1)
    out, res = ours(x2, r2)
    torch.autograd.backward((ref_out, ref_res), (dh, dr))
    torch.autograd.backward((out, res), (dh, dr))
    for a, e in (
        (out, ref_out),
        (res, ref_res),
        (ours.weight.grad, reference.weight.grad),
        (x2.grad, x1.grad),
        (r2.grad, r1.grad),
    ):
        torch.testing.assert_close(a, e, atol=atol, rtol=rtol)


@pytest.mark.parametrize("shape", [(2, 8, 64), (1, 1, 1023), (3, 7, 256)])
def test_liger_layer_norm_cases(shape):
    torch.manual_seed(0)
    x = torch.randn(shape)
    ours, theirs = fused.nn.FusedLayerNorm(shape[-1], eps=1e-6), nn.LayerNorm(shape[-1], eps=1e-6)
    with torch.no_grad():
        for p in (ours.weight, ours.bias):
            p.normal_()
    theirs.load_state_dict(ours.state_dict())
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    g = torch.randn(shape)
    ours(x1).backward(g)
    theirs(x2).backward(g)
    for a, e in ((x1.grad, x2.grad), (ours.weight.grad, theirs.weight.grad), (ours.bias.grad, theirs.bias.grad)):
        torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- gradcheck, opcheck, compile
@pytest.mark.parametrize("op", OPS)
def test_gradcheck(op):
    x, r, w, b = inputs(op, (3, 2, 7), (2, 7), torch.float64, "cpu")
    params = [t for t in (x, r if "add" in op else None, w, b) if t is not None]

    def fn(*ts):
        it = iter(ts)
        args = [next(it)] + ([next(it)] if "add" in op else []) + [(2, 7), next(it)]
        if "layer" in op:
            args.append(next(it))
        return getattr(fused, op)(*args)

    assert torch.autograd.gradcheck(fn, params)


def test_opcheck_with_residual_dtype():
    """opcheck with the keyword-only residual_dtype (tests/op_registry.py's samples, run by test_op_coverage.py,
    are positional)."""
    x, r, w, _ = inputs("add_rms_norm", (3, 5, 16), (16,), torch.bfloat16, "cpu")
    torch.library.opcheck(
        torch.ops.fused.add_rms_norm.default, (x, r, [16], w.float(), 1e-6), {"residual_dtype": torch.float32}
    )
    torch.library.opcheck(
        torch.ops.fused.add_layer_norm.default, (x, r, [16], None, None, 1e-5), {"residual_dtype": torch.float32}
    )


def test_compile_fullgraph_forward_and_backward():
    x, r, w, b = inputs("add_layer_norm", (3, 5, 16), (16,), torch.float32, "cpu")
    check_compile(lambda x, r: fused.add_rms_norm(x, r, 16, w.detach()), x.detach(), r.detach())
    check_compile(lambda x: fused.layer_norm(x, (5, 16)), x.detach())

    def step(x, r, w, b):
        out, h = fused.add_layer_norm(x, r, 16, w, b)
        return (out * out).sum() + h.sum()

    torch._dynamo.reset()
    expected = torch.autograd.grad(step(x, r, w, b), (x, r, w, b))
    got = torch.autograd.grad(torch.compile(step, fullgraph=True)(x, r, w, b), (x, r, w, b))
    for a, e in zip(got, expected):
        torch.testing.assert_close(a, e)


# ---------------------------------------------------------------- nn modules
def test_modules_are_torch_modules_with_their_state_dicts():
    torch.manual_seed(0)
    ln, rms = nn.LayerNorm((4, 6)), nn.RMSNorm(6, eps=1e-5)
    with torch.no_grad():
        ln.weight.normal_(), ln.bias.normal_(), rms.weight.normal_()
    fln, frms = fused.nn.FusedLayerNorm((4, 6)), fused.nn.FusedRMSNorm(6, eps=1e-5)
    fln.load_state_dict(ln.state_dict())
    frms.load_state_dict(rms.state_dict())
    assert isinstance(fln, nn.LayerNorm) and isinstance(frms, nn.RMSNorm)
    assert repr(fln) == "Fused" + repr(ln) and repr(frms) == "Fused" + repr(rms)
    back = nn.LayerNorm((4, 6))
    back.load_state_dict(fln.state_dict())
    assert torch.equal(back.weight, ln.weight) and torch.equal(back.bias, ln.bias)
    x, r = make((3, 4, 6)), make((3, 4, 6), seed=1)
    assert_close(fln(x), ln(x))
    assert_close(frms(x), rms(x))
    out, h = fln(x, r)
    assert torch.equal(h, x + r) and torch.equal(out, fln(x + r))
    out, h = frms(x.bfloat16(), r, residual_dtype=torch.float32)
    assert out.dtype == torch.bfloat16 and h.dtype == torch.float32
    assert set(fused.nn.FusedLayerNorm(6, bias=False).state_dict()) == {"weight"}
    assert fused.nn.FusedRMSNorm(6, elementwise_affine=False).weight is None
    assert fused.nn.FusedLayerNorm(6, dtype=torch.float16).weight.dtype == torch.float16


class AddNormBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.rms, self.ln = fused.nn.FusedRMSNorm(d), fused.nn.FusedLayerNorm(d)

    def forward(self, x, r):
        h, total = self.rms(x, r)
        return self.ln(h) + total


@ignore_torch_jit_deprecation  # torch.jit is deprecated, not gone
def test_modules_trace_and_save_with_torch_jit(tmp_path):
    """torch.jit.trace of a model with trainable fused norms (as of nn.RMSNorm / nn.LayerNorm) passes trace's own
    check, and torch.jit.save / load keeps its outputs and gradients: the trace holds fused ops, not Python calls."""
    torch.manual_seed(0)
    model = AddNormBlock(16)
    x, r = make((2, 3, 16), requires_grad=True), make((2, 3, 16), seed=1)
    path = tmp_path / "model.pt"
    torch.jit.save(torch.jit.trace(model, (x, r)), path)
    loaded = torch.jit.load(path)
    x2, r2 = make((5, 3, 16), seed=2, requires_grad=True), make((5, 3, 16), seed=3)
    out, expected = loaded(x2, r2), model(x2, r2)
    assert_close(out, expected)
    assert_close(torch.autograd.grad(out.sum(), x2)[0], torch.autograd.grad(expected.sum(), x2)[0])


# ---------------------------------------------------------------- real clients
class Attention(nn.Module):
    def __init__(self, d, heads, bias):
        super().__init__()
        self.heads, self.qkv, self.proj = heads, nn.Linear(d, 3 * d, bias=bias), nn.Linear(d, d, bias=bias)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, D))


class SwiGLU(nn.Module):
    def __init__(self, d, hidden):
        super().__init__()
        self.gate_up, self.down = nn.Linear(d, 2 * hidden, bias=False), nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, -1)
        return self.down(F.silu(gate) * up)


class TinyTransformer(nn.Module):
    """Pre-norm blocks (GPT-2: LayerNorm, GELU MLP; Llama: RMSNorm, SwiGLU) and a final norm. With fused norms,
    each residual add runs inside the norm that follows it: norm(x + sublayer) and the new x in one op."""

    def __init__(self, kind, d=32, heads=4, blocks=2, vocab=50):
        super().__init__()
        norm = (lambda: nn.LayerNorm(d)) if kind == "gpt2" else (lambda: nn.RMSNorm(d, eps=1e-6))
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(
            nn.ModuleDict(
                {
                    "ln_1": norm(),
                    "attn": Attention(d, heads, bias=kind == "gpt2"),
                    "ln_2": norm(),
                    "mlp": nn.Sequential(nn.Linear(d, 4 * d), nn.GELU("tanh"), nn.Linear(4 * d, d))
                    if kind == "gpt2"
                    else SwiGLU(d, 3 * d),
                }
            )
            for _ in range(blocks)
        )
        self.ln_f = norm()
        self.head = nn.Linear(d, vocab, bias=False)

    def norms(self):
        return [m for m in self.modules() if isinstance(m, (nn.LayerNorm, nn.RMSNorm))]

    def forward(self, idx):
        x, pending = self.emb(idx), None  # pending: a sublayer output not yet added to the stream x
        for norm, sublayer in [(b[n], b[s]) for b in self.blocks for n, s in (("ln_1", "attn"), ("ln_2", "mlp"))] + [
            (self.ln_f, None)
        ]:
            if pending is None:
                h = norm(x)
            elif isinstance(norm, (fused.nn.FusedLayerNorm, fused.nn.FusedRMSNorm)):
                h, x = norm(pending, x)
            else:
                x = x + pending
                h = norm(x)
            pending = sublayer(h) if sublayer is not None else None
        return self.head(h)


def fuse_norms(model):
    for parent in model.modules():
        for name, child in list(parent.named_children()):
            if type(child) in (nn.LayerNorm, nn.RMSNorm):
                cls = fused.nn.FusedLayerNorm if isinstance(child, nn.LayerNorm) else fused.nn.FusedRMSNorm
                new = cls.__new__(cls)
                new.__dict__ = child.__dict__.copy()
                setattr(parent, name, new)
    return model


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_real_client_transformer_outputs_and_gradients(kind):
    """The model with fused norms and fused residual adds gives eager's outputs and gradients, judged against the
    float64 model (error no worse than eager's x2)."""
    import copy

    torch.manual_seed(0)
    eager = TinyTransformer(kind)
    for m in eager.norms():  # random affine parameters, so that their gradients matter
        with torch.no_grad():
            for p in m.parameters():
                p.uniform_(0.5, 1.5)
    ours = fuse_norms(copy.deepcopy(eager))
    assert all(isinstance(m, (fused.nn.FusedLayerNorm, fused.nn.FusedRMSNorm)) for m in ours.norms())
    exact = copy.deepcopy(eager).double()
    idx = torch.randint(0, 50, (3, 11), generator=torch.Generator().manual_seed(1))
    target = torch.randn(3, 11, 50, generator=torch.Generator().manual_seed(2))
    results = []
    for model in (ours, eager, exact):
        out = model(idx)
        (out * target.to(out.dtype)).sum().backward()
        results.append([out] + [p.grad for p in model.parameters()])
    assert len(results[0]) == len(list(eager.parameters())) + 1
    for o, e, x in zip(*results):
        assert_accuracy(o, e, x)
