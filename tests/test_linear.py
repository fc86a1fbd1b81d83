"""Parity, accuracy, gradients, compile and error tests of fused.linear_act (CPU kernel, Triton launchers under
the interpreter, and the CUDA kernels when a GPU is present)."""

import math

import pytest
import torch

import fused
from fused.elementwise.reference import ACT_FNS
from fused.linear.reference import linear_act as reference
from tests.harness import (
    ALL_DTYPES,
    FLOAT_DTYPES,
    HAS_CUDA,
    assert_accuracy,
    assert_close,
    backend,
    check_compile,
    make,
    noncontiguous,
    raises,
    requires_cuda,
    requires_triton,
)

ACTS = list(ACT_FNS)
# Per-dtype tolerance scale for a K-long dot product against the same-dtype reference (different summation order).
GEMM_SCALE = {torch.float64: 10.0, torch.float32: 10.0, torch.float16: 2.0, torch.bfloat16: 2.0}
# Gradients go through a second GEMM over 16-bit grad_pre whose last-bit roundings may differ from eager's.
GRAD_SCALE = {torch.float64: 20.0, torch.float32: 20.0, torch.float16: 10.0, torch.bfloat16: 4.0}


def inputs(x_shape, n_out, dtype, device="cpu", bias=True, requires_grad=False, seed=0):
    k = x_shape[-1]
    bound = 1.0 / max(k, 1) ** 0.5  # nn.Linear's scale keeps pre-activations O(1) whatever K
    x = make(x_shape, dtype, device, seed=seed, requires_grad=requires_grad)
    w = make((n_out, k), dtype, device, low=-bound, high=bound, seed=seed + 1, requires_grad=requires_grad)
    b = make((n_out,), dtype, device, seed=seed + 2, requires_grad=requires_grad) if bias else None
    return x, w, b


def grads(fn, tensors, grad_out):
    out = fn(*tensors)
    leaves = [t for t in tensors if t is not None]
    return out, torch.autograd.grad(out, leaves, grad_out)


# ---- forward and backward against the reference in the same dtype ----
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_parity_odd_shape(dev, act, dtype):
    x, w, b = inputs((3, 5, 131), 67, dtype, dev, requires_grad=True)
    if dev == "cuda" and fused.get_backend() == "triton" and dtype == torch.float64:
        # the Triton GEMM takes fp32, fp16, bf16 and says so
        with raises("fused.linear_act: the Triton kernel takes float32, float16 or bfloat16"):
            fused.linear_act(x, w, b, act)
        return
    g = make((3, 5, 67), dtype, dev, seed=9)
    out, got = grads(lambda *t: fused.linear_act(*t, act=act), (x, w, b), g)
    ref, want = grads(lambda *t: reference(*t, act=act), (x, w, b), g)
    assert out.shape == (3, 5, 67) and out.dtype == dtype
    assert_close(out, ref, scale=GEMM_SCALE[dtype])
    for name, a, e in zip(("x", "weight", "bias"), got, want):
        assert a.shape == e.shape, name
        assert_close(a, e, scale=GRAD_SCALE[dtype])


@pytest.mark.parametrize("act", ["identity", "relu", "gelu"])
def test_no_bias_noncontiguous_and_1d(dev, act):
    x, w, _ = inputs((7, 40), 24, torch.float32, dev)
    xs, ws = noncontiguous(x).requires_grad_(), noncontiguous(w).t().contiguous().t().requires_grad_()  # w.T strides
    assert not xs.is_contiguous() and not ws.is_contiguous()
    g = make((7, 24), torch.float32, dev, seed=3)
    out, got = grads(lambda a, c: fused.linear_act(a, c, None, act), (xs, ws), g)
    one = fused.linear_act(x[0], w, None, act)
    ref, want = grads(lambda a, c: reference(a, c, None, act), (xs, ws), g)
    assert_close(out, ref, scale=10)
    assert_close(one, ref[0], scale=10)
    for a, e in zip(got, want):
        assert_close(a, e, scale=10)


@pytest.mark.parametrize("act", ["gelu", "tanh"])
def test_large_shape(dev, act):
    x, w, b = inputs((4, 256, 384), 320, torch.float32, dev, requires_grad=True)
    g = make((4, 256, 320), torch.float32, dev, seed=5)
    out, got = grads(lambda *t: fused.linear_act(*t, act=act), (x, w, b), g)
    ref, want = grads(lambda *t: reference(*t, act=act), (x, w, b), g)
    assert_close(out, ref, scale=10)
    for a, e in zip(got, want):
        assert_close(a, e, scale=50)  # the weight and bias gradients sum over 1024 rows


@pytest.mark.parametrize("shape,n_out", [((0, 8), 5), ((4, 0), 5), ((4, 8), 0), ((2, 0, 8), 3)])
def test_empty(dev, shape, n_out):
    x, w, b = inputs(shape, n_out, torch.float32, dev, requires_grad=True)
    out = fused.linear_act(x, w, b, "gelu")
    gx, gw, gb = torch.autograd.grad(out.sum(), (x, w, b))
    ref = reference(x, w, b, "gelu")
    assert out.shape == ref.shape
    assert_close(out, ref)  # with in_features == 0: gelu(bias) on every row
    assert gx.shape == x.shape and gw.shape == w.shape and gb.shape == b.shape
    want = torch.autograd.grad(ref.sum(), (x, w, b))
    for a, e in zip((gx, gw, gb), want):
        assert_close(a, e)


# ---- accuracy against float64: no worse than eager nn.Linear + activation (x2) ----
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_accuracy_vs_float64(dev, act, dtype):
    x, w, b = inputs((96, 160), 72, dtype, dev, requires_grad=True)
    g = make((96, 72), dtype, dev, seed=4)
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
    out, got = grads(lambda *t: fused.linear_act(*t, act=act), (x, w, b), g)
    eager, want = grads(lambda *t: reference(*t, act=act), (x, w, b), g)
    ref64, exact = grads(lambda *t: reference(*t, act=act), (x64, w64, b64), g.double())
    assert_accuracy(out, eager, ref64)
    for a, e, r in zip(got, want, exact):
        assert_accuracy(a, e, r)


def test_gradcheck_float64():
    for act in ACTS:
        x, w, b = inputs((2, 3, 6), 5, torch.float64, requires_grad=True)
        assert torch.autograd.gradcheck(lambda *t: fused.linear_act(*t, act=act), (x, w, b))
    x, w, _ = inputs((4, 6), 5, torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, c: fused.linear_act(a, c, None, "silu"), (x, w))


def test_pre_activation_saved_only_when_needed():
    """gelu, gelu_tanh, silu keep the pre-activation for backward; relu, sigmoid, tanh keep only the output."""
    x, w, b = inputs((8, 16), 12, torch.float32, requires_grad=True)
    for act in ACTS:
        out, pre = torch.ops.fused.linear_act_fwd(x, w, b, act, True)
        assert pre.shape == ((8, 12) if act in ("gelu", "gelu_tanh", "silu") else (0,)), act
        if pre.numel():
            torch.testing.assert_close(pre, torch.nn.functional.linear(x, w, b))
    with torch.no_grad():
        assert torch.ops.fused.linear_act_fwd(x, w, b, "gelu", False)[1].numel() == 0
    # called directly without the pre-activation, autograd recomputes it and the gradient is still right
    out = torch.ops.fused.linear_act_fwd(x, w, b, "gelu", False)[0]
    got = torch.autograd.grad(out.sum(), (x, w, b))
    want = torch.autograd.grad(reference(x, w, b, "gelu").sum(), (x, w, b))
    for a, e in zip(got, want):
        assert_close(a, e, scale=10)


def test_bias_gradient_deterministic():
    x, w, b = inputs((2000, 33), 300, torch.float32, requires_grad=True)
    g = make((2000, 300), torch.float32, seed=6)
    first = torch.autograd.grad(fused.linear_act(x, w, b, "silu"), b, g)[0]
    for threads in (1, 2):
        old = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            again = torch.autograd.grad(fused.linear_act(x, w, b, "silu"), b, g)[0]
        finally:
            torch.set_num_threads(old)
        assert torch.equal(first, again)


@pytest.mark.parametrize("act", ["gelu", "gelu_tanh", "silu", "relu"])
def test_backward_memory(act):
    """Training memory as eager Linear + activation: the saved pre-activation is not a differentiable output (no
    zero gradient of the output's size is filled for it), and on the CPU the activations that need it run as two
    autograd nodes, so backward frees it before the GEMMs, with the single fused op's bits."""
    from benchmarks.timing import peak_memory_mb
    from fused.elementwise.reference import ACT_FNS

    x, w, b = inputs((256, 128), 128, torch.float32, requires_grad=True)
    assert not torch.ops.fused.linear_act_fwd(x, w, b, act, True)[1].requires_grad

    def fwd_bwd(fn):
        def run():
            out = fn()
            return out, torch.autograd.grad(out, (x, w, b), torch.ones_like(out))

        return run

    ours = fwd_bwd(lambda: fused.linear_act(x, w, b, act))
    eager = fwd_bwd(lambda: ACT_FNS[act](torch.nn.functional.linear(x, w, b)))
    assert peak_memory_mb(ours, "cpu") <= peak_memory_mb(eager, "cpu")
    single_op = fwd_bwd(lambda: torch.ops.fused.linear_act_fwd(x, w, b, act, True)[0])
    for a, e in zip((ours()[0], *ours()[1]), (single_op()[0], *single_op()[1])):
        assert torch.equal(a, e)


@pytest.mark.parametrize("act", ACTS)
def test_nan_inf_propagate(act):
    x, w, b = inputs((4, 16), 8, torch.float32)
    x[1, 3] = float("nan")
    if act in ("identity", "relu", "sigmoid", "tanh"):  # eager's CPU gelu / silu map +-inf to NaN
        x[2, 0] = float("inf")
    out, ref = fused.linear_act(x, w, b, act), reference(x, w, b, act)
    assert out[1].isnan().all()
    assert_close(out, ref, scale=10)  # equal_nan: the same NaN and inf pattern


@pytest.mark.parametrize("act", ["relu", "gelu"])
def test_compile_fullgraph(act):
    x, w, b = inputs((6, 24), 20, torch.float32, requires_grad=True)

    check_compile(lambda x, w, b: fused.linear_act(x, w, b, act), x.detach(), w.detach(), b.detach())
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, w, b: fused.linear_act(x, w, b, act).square().sum(), fullgraph=True)
    got = torch.autograd.grad(compiled(x, w, b), (x, w, b))
    want = torch.autograd.grad(reference(x, w, b, act).square().sum(), (x, w, b))
    for a, e in zip(got, want):
        assert_close(a, e, scale=10)


def test_errors_name_op_and_argument():
    x, w, b = inputs((4, 8), 5, torch.float32)
    with raises("fused.linear_act: unknown act 'swish'"):
        fused.linear_act(x, w, b, "swish")
    with raises("fused.linear_act: weight must be 2-D .* got weight of shape \\(5, 7\\)"):
        fused.linear_act(x, w[:, :7], b)
    with raises("fused.linear_act: weight must be 2-D"):
        fused.linear_act(x, w[0], b)
    with raises("fused.linear_act: bias must be 1-D with out_features"):
        fused.linear_act(x, w, b[:4])
    with raises("fused.linear_act: weight has dtype torch.float64 but x has dtype torch.float32"):
        fused.linear_act(x, w.double(), b)
    with raises("fused.linear_act: bias has dtype torch.float16"):
        fused.linear_act(x, w, b.half())
    with raises("fused.linear_act: x must be a floating-point tensor"):
        fused.linear_act(x.long(), w.long())
    with raises("fused.linear_act: weight is on meta but x is on cpu"):
        fused.linear_act(x, w.to("meta"), b)
    # the C++ kernels check the same, naming op and argument
    with raises("fused.linear_act: weight must be 2-D"):
        torch.ops.fused.linear_act_fwd.default.redispatch(torch._C.DispatchKeySet("CPU"), x, w[:, :7], b, "relu", False)
    with raises("fused.linear_act_grad_pre: grad shape"):
        torch.ops.fused.linear_act_grad_pre(x, x[:, :3], "gelu", True)
    with raises("fused.linear_act_grad_pre: unknown act 'bad'"):
        torch.ops.fused.linear_act_grad_pre(x, x, "bad", True)


# ---- the Triton kernels, under the interpreter on CPU where no GPU is present ----
@requires_triton
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("act", ACTS)
def test_triton_forward(dtype, act):
    from fused.linear import triton_kernels

    device = "cuda" if HAS_CUDA else "cpu"
    x, w, b = inputs((2, 19, 45), 37, dtype, device)
    save = act in ("gelu", "gelu_tanh", "silu")
    bias = b if act != "relu" else None
    out, pre = triton_kernels.linear_act_fwd(x, w, bias, act, True)
    ref = reference(x, w, bias, act)
    assert out.shape == ref.shape and out.dtype == dtype
    assert_close(out, ref, scale=GEMM_SCALE[dtype])
    assert pre.shape == (ref.shape if save else (0,))
    if save:
        assert_close(pre, torch.nn.functional.linear(x, w, b), scale=GEMM_SCALE[dtype])
    x64, w64, b64 = (t.double() for t in (x, w, b))
    if act != "relu":
        assert_accuracy(out, ref, reference(x64, w64, b64, act))
    if dtype == torch.float32:  # one copy of the activation math: the epilogue gives fused.bias_act's bits
        from fused.elementwise import triton_kernels as elementwise

        gemm, _ = triton_kernels.linear_act_fwd(x, w, bias, "identity", False)
        assert torch.equal(out, elementwise.bias_act(gemm, None, act))


@requires_triton
def test_triton_forward_strided_and_empty():
    from fused.linear import triton_kernels

    device = "cuda" if HAS_CUDA else "cpu"
    x, w, b = inputs((33, 40), 20, torch.float32, device)
    xs, ws = noncontiguous(x), w.t().contiguous().t()
    bs = noncontiguous(b)  # a strided bias (the kernel reads it contiguously: the launcher must copy)
    out, _ = triton_kernels.linear_act_fwd(xs, ws, bs, "silu", False)
    assert_close(out, reference(x, w, b, "silu"), scale=10)
    x, w, b = inputs((130, 40), 96, torch.float32, device)  # 5 x 3 tiles: a partial group of row tiles
    out, _ = triton_kernels.linear_act_fwd(x, w, b, "relu", False)
    assert_close(out, reference(x, w, b, "relu"), scale=10)
    out, _ = triton_kernels.linear_act_fwd(x[:0], w, b, "silu", False)
    assert out.shape == (0, 96)
    out, _ = triton_kernels.linear_act_fwd(x[:, :0], w[:, :0], b, "gelu", False)  # in_features == 0
    assert_close(out, reference(x[:, :0], w[:, :0], b, "gelu"))


@requires_triton
def test_triton_tf32_only_when_allowed():
    from fused.linear.triton_kernels import dot_precision

    old = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        assert dot_precision(torch.float32) == "ieee"
        torch.backends.cuda.matmul.allow_tf32 = True
        assert dot_precision(torch.float32) == "tf32"
        assert dot_precision(torch.bfloat16) == "ieee"  # 16-bit inputs: tensor cores, exact products
        if hasattr(torch.backends.cuda.matmul, "fp32_precision"):  # the new API (reading allow_tf32 then raises)
            torch.backends.cuda.matmul.fp32_precision = "tf32"
            assert dot_precision(torch.float32) == "tf32"
            torch.backends.cuda.matmul.fp32_precision = "ieee"
            assert dot_precision(torch.float32) == "ieee"
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


@requires_triton
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("act", ACTS)
def test_triton_grad_pre(dtype, act):
    from fused.linear import triton_kernels

    device = "cuda" if HAS_CUDA else "cpu"
    grad, saved = make((3, 41, 70), dtype, device, seed=1), make((3, 41, 70), dtype, device, seed=2)
    if act in ("sigmoid", "tanh"):
        saved = saved.sigmoid() if act == "sigmoid" else saved.tanh()
    got_pre, got_bias = triton_kernels.linear_act_grad_pre(grad, saved, act, True)
    want_pre, want_bias = torch.ops.fused.linear_act_grad_pre(grad.cpu(), saved.cpu(), act, True)
    assert_close(got_pre.cpu(), want_pre, scale=2)
    assert_close(got_bias.cpu(), want_bias, scale=20)
    assert triton_kernels.linear_act_grad_pre(grad, saved, act, False)[1].numel() == 0
    if dtype == torch.float32 and act in ("gelu", "gelu_tanh", "silu"):  # saved is the pre-activation: bias_act's
        from fused.elementwise import triton_kernels as elementwise  # backward has the same derivative, same bits

        assert torch.equal(got_pre, elementwise.bias_act_backward(grad, saved, None, act)[0])
    # relu selects, as eager's threshold_backward: an inf or NaN gradient where the output is 0 gives 0
    grad, saved = grad[0, :2, :5].clone(), saved[0, :2, :5].clone()
    grad[0] = torch.tensor([math.inf, math.nan, -math.inf, 1.0, math.nan])
    saved[0] = torch.tensor([0.0, -1.0, 0.0, 2.0, math.nan])
    got_pre, got_bias = triton_kernels.linear_act_grad_pre(grad, saved, act, True)
    want_pre, want_bias = torch.ops.fused.linear_act_grad_pre(grad.cpu(), saved.cpu(), act, True)
    assert_close(got_pre.cpu(), want_pre, scale=2)
    assert_close(got_bias.cpu(), want_bias, scale=20)


@requires_triton
def test_triton_autotuning_keyed_on_m_bucket(monkeypatch):
    """The autotuned launcher (GPU path; here under the interpreter with a stand-in timer) tunes once per
    power-of-two bucket of M, not per M, while the kernel still gets the exact M."""
    from fused.linear import triton_kernels as tk

    tuned = tk._linear_act_tuned
    assert tuned.keys == ["M_BUCKET", "N", "K"]
    assert [tk.m_bucket(m) for m in (1, 16, 17, 32, 33, 1000)] == [16, 16, 32, 32, 64, 1024]
    if HAS_CUDA:
        return  # below: the interpreter's CPU run of the tuned kernel
    timed = []
    monkeypatch.setattr(tk, "INTERPRET", False)
    monkeypatch.setattr(tuned, "configs", [tk._config(16, 32, 16, 2, 4), tk._config(32, 32, 16, 2, 4)])
    monkeypatch.setattr(tuned, "cache", {})
    # the timer is a cached property (the GPU driver's): an instance entry stands in for it, counting calls
    fake_timer = lambda call, quantiles: (timed.append(call), [1.0] * len(quantiles))[1]  # noqa: E731
    monkeypatch.setitem(vars(tuned), "do_bench", fake_timer)
    w, b = make((24, 40), seed=1), make((24,), seed=2)
    for m, tunings in ((17, 1), (30, 1), (32, 1), (33, 2), (5, 3), (64, 3)):
        x = make((m, 40), seed=m)
        out, _ = tk.linear_act_fwd(x, w, b, "gelu", False)
        assert_close(out, reference(x, w, b, "gelu"), scale=10)
        assert len(timed) == 2 * tunings, m  # each new bucket times both configs once
    assert sorted(key[0] for key in tuned.cache) == [16, 32, 64]


# ---- the CUDA kernels (GPU only) ----
@requires_cuda
@pytest.mark.parametrize("bk", ["cuda", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_matches_cpu_kernel(bk, dtype):
    x, w, b = inputs((300, 256), 520, dtype, requires_grad=True)
    g = make((300, 520), dtype, seed=8)
    want_out, want = grads(lambda *t: fused.linear_act(*t, act="gelu"), (x, w, b), g)
    xc, wc, bc = (t.detach().cuda().requires_grad_() for t in (x, w, b))
    with backend(bk):
        out, got = grads(lambda *t: fused.linear_act(*t, act="gelu"), (xc, wc, bc), g.cuda())
    assert_close(out.cpu(), want_out, scale=GEMM_SCALE[dtype] * 2)
    for a, e in zip(got, want):
        assert_close(a.cpu(), e, scale=GRAD_SCALE[dtype] * 2)


@requires_cuda
@pytest.mark.parametrize("bk", ["cuda", "triton"])
@pytest.mark.parametrize("act", ACTS)
def test_cuda_kernels_each_act(bk, act):
    x, w, b = inputs((2, 150, 96), 200, torch.float32)
    grad, saved = make((2, 150, 200), seed=1), make((2, 150, 200), seed=2)
    want_out, want_pre = torch.ops.fused.linear_act_fwd(x, w, b, act, True)
    want_gpre, want_gbias = torch.ops.fused.linear_act_grad_pre(grad, saved, act, True)
    old_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 products exact, as on the CPU
    try:
        with backend(bk):
            out, pre = torch.ops.fused.linear_act_fwd(x.cuda(), w.cuda(), b.cuda(), act, True)
            gpre, gbias = torch.ops.fused.linear_act_grad_pre(grad.cuda(), saved.cuda(), act, True)
            again = torch.ops.fused.linear_act_grad_pre(grad.cuda(), saved.cuda(), act, True)[1]
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old_tf32
    assert_close(out.cpu(), want_out, scale=10)
    assert pre.shape == want_pre.shape
    if pre.numel():
        assert_close(pre.cpu(), want_pre, scale=10)
    assert_close(gpre.cpu(), want_gpre)
    assert_close(gbias.cpu(), want_gbias, scale=10)
    assert torch.equal(gbias, again)  # deterministic bias reduction


@requires_cuda
def test_cuda_backend_float64():
    x, w, b = inputs((33, 20), 17, torch.float64, requires_grad=True)
    with backend("cuda"):
        xc, wc, bc = (t.detach().cuda().requires_grad_() for t in (x, w, b))
        assert torch.autograd.gradcheck(lambda *t: fused.linear_act(*t, act="gelu"), (xc, wc, bc))


@pytest.mark.parametrize("act", ["identity", "gelu", "relu"])
def test_autocast_as_nn_linear(act):
    """Under torch.autocast the op runs as F.linear does there: fp32 inputs and parameters cast to the autocast
    dtype, 16-bit activations meet fp32 parameters, the result in the autocast dtype, fp32 parameter gradients;
    FusedLinear and FusedMLP alike."""
    torch.manual_seed(0)
    ref = torch.nn.Linear(24, 16)
    ours = fused.nn.FusedLinear(24, 16, act=act)
    ours.load_state_dict(ref.state_dict())
    activation = {"identity": lambda t: t, "gelu": torch.nn.functional.gelu, "relu": torch.relu}[act]
    for x in (make((5, 24), requires_grad=True), make((5, 24), torch.bfloat16, requires_grad=True)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want, got = activation(ref(x)), ours(x)
        assert got.dtype == want.dtype == torch.bfloat16
        # float64 of the operands autocast gives both (bf16-rounded x, weight, bias)
        operands = [t.detach().bfloat16().double().requires_grad_() for t in (x, ref.weight, ref.bias)]
        exact = activation(torch.nn.functional.linear(*operands))
        assert_accuracy(got, want, exact)
        grads = torch.autograd.grad(got.float().sum(), (x, ours.weight, ours.bias))
        ref_grads = torch.autograd.grad(want.float().sum(), (x, ref.weight, ref.bias))
        exact_grads = torch.autograd.grad(exact.sum(), operands)
        for g, r, e in zip(grads, ref_grads, exact_grads):
            assert g.dtype == r.dtype
            assert_accuracy(g.double(), r.double(), e, floor=4 * torch.finfo(torch.bfloat16).eps)
    mlp = fused.nn.FusedMLP([24, 32, 8], act=act)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert mlp(make((5, 24), torch.bfloat16)).dtype == torch.bfloat16
