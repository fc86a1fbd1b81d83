"""The loss family: fused.linear_cross_entropy, fused.cross_entropy and nn.FusedLinearCrossEntropyLoss against the
reference (fused/loss/reference.py: torch's F.cross_entropy plus the z_loss and softcap extensions) and against
float64; the row kernel's Triton launcher under the interpreter (and compiled for sm_90), its CUDA C++ kernel in
the CUDA host emulation; a GPT-2-style model trained with the fused loss, in one process and under FSDP2 with 2
gloo processes.

Ported cases (adapted to these ops, small shapes):
- torch test/nn/test_linear_cross_entropy.py: all targets ignored (mean nan, sum 0, none zeros), parameter
  validation (reduction, label_smoothing), gradcheck, forward/backward against the reference for a 3-D input with
  V = 6000, many row chunks (1500 rows), every reduction x label smoothing with ignore_index=-1.
- Liger-Kernel test/transformers/test_cross_entropy.py: correctness per reduction on a weird shape, ignore_index
  inside the class range, label smoothing with ignore_index, softcap, z_loss (PaLM 1e-4, Chameleon 1e-5) with
  label smoothing / ignore_index / reduction, class weights with the other options, "not last layer" (loss * 3),
  out-of-bounds targets, bf16 against fp32 internals, and PR #1329's true-class gradient of confident predictions.
- Liger-Kernel test/transformers/test_fused_linear_cross_entropy.py: the same options through the linear head with
  and without bias, and reduction="none" gradients (Liger issue #968).
- torch test_nn.py's cross-entropy cases: label smoothing with class weights and ignored targets per reduction,
  K-dimensional (N, C, d1, ...) logits, 1-D logits with a 0-d target, empty batches, uint8 targets.
- torch's OpInfo samples (op_db) of F.cross_entropy and F.linear_cross_entropy: class-probability targets,
  K-dimensional linear weights and biases, class weights, ignore_index, reductions, in every dtype.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fused
from fused.loss import chunked
from fused.loss import reference as ref
from tests import cuda_emulation
from tests.harness import (
    ALL_DTYPES,
    FLOAT_DTYPES,
    HAS_CUDA,
    SEEDS,
    TRITON_DEVICE,
    assert_accuracy,
    assert_accuracy_over_seeds,
    assert_close,
    check_compile,
    compile_for_sm90,
    make,
    noncontiguous,
    raises,
    rel_error,
    requires_triton,
)
from tests.test_cuda_emulation import buf, launch, out

GEMM_SCALE = {torch.float64: 10.0, torch.float32: 10.0, torch.float16: 4.0, torch.bfloat16: 4.0}
# Every option at once: class weights, label smoothing, z-loss, softcap (and ignored rows, from `targets`).
ALL_OPTIONS = dict(label_smoothing=0.1, z_loss=1e-2, softcap=4.0)


# torch.nn.functional.linear_cross_entropy, the comparison of these tests, came with torch 2.13.
needs_torch_linear_cross_entropy = pytest.mark.skipif(
    not hasattr(F, "linear_cross_entropy"), reason="torch.nn.functional.linear_cross_entropy needs torch 2.13 or newer"
)


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    """A few rows per chunk, so every test runs the chunked path over several chunks."""
    monkeypatch.setattr(chunked, "CHUNK_BYTES", 4096)


def targets(shape, classes, device="cpu", ignore_index=-100, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, classes, shape, generator=g)
    t.view(-1)[::5] = ignore_index
    return t.to(device)


def lce_inputs(shape, D, V, dtype=torch.float32, device="cpu", bias=True, requires_grad=True, seed=0):
    bound = 1.0 / math.sqrt(D)  # nn.Linear's scale: logits O(1) whatever D
    x = make((*shape, D), dtype, device, low=-2, high=2, seed=seed, requires_grad=requires_grad)
    w = make((V, D), dtype, device, low=-3 * bound, high=3 * bound, seed=seed + 1, requires_grad=requires_grad)
    b = make((V,), dtype, device, low=-1, high=1, seed=seed + 2, requires_grad=requires_grad) if bias else None
    return x, w, b


def class_weight(V, dtype=torch.float32, device="cpu", seed=3):
    return make((V,), dtype, device, low=0.2, high=2.0, seed=seed)


def loss_and_grads(fn, leaves, grad_out=None):
    out = fn()
    leaves = [t for t in leaves if t is not None]
    return out, torch.autograd.grad(out, leaves, grad_out if out.dim() else None)


def lce(x, w, b, t, **kw):
    return fused.linear_cross_entropy(x, w, t, linear_bias=b, **kw)


def lce_ref(x, w, b, t, **kw):
    return ref.linear_cross_entropy(x, w, t, b, **kw)


# ---- linear_cross_entropy against the reference in the same dtype ----
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("options", ["plain", "all"])
def test_linear_parity(dev, reduction, dtype, options):
    x, w, b = lce_inputs((3, 5), 33, 131, dtype, dev)
    t = targets((3, 5), 131, dev)
    kw = dict(reduction=reduction)
    if options == "all":
        kw.update(ALL_OPTIONS, weight=class_weight(131, dtype, dev))
    g = make((3, 5), dtype, dev, seed=7) if reduction == "none" else None
    out, got = loss_and_grads(lambda: lce(x, w, b, t, **kw), (x, w, b), g)
    want_out, want = loss_and_grads(lambda: lce_ref(x, w, b, t, **kw), (x, w, b), g)
    assert out.dtype == dtype and out.shape == want_out.shape
    assert_close(out, want_out, scale=GEMM_SCALE[dtype])
    for name, a, e in zip(("input", "linear_weight", "linear_bias"), got, want):
        assert a.shape == e.shape and a.dtype == e.dtype, name
        assert_close(a, e, scale=2 * GEMM_SCALE[dtype])


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize(
    "option",
    [dict(label_smoothing=0.2), dict(z_loss=1e-4), dict(z_loss=1e-5), dict(softcap=30.0), dict(softcap=2.0), "weight"],
    ids=str,
)
def test_linear_each_option(dev, reduction, option):
    """Each extension alone (z_loss: PaLM's and Chameleon's coefficients) in float64, gradients against autograd
    of the reference."""
    x, w, b = lce_inputs((2, 9), 16, 70, torch.float64, dev)
    t = targets((2, 9), 70, dev)
    kw = dict(weight=class_weight(70, torch.float64, dev)) if option == "weight" else dict(option)
    g = make((2, 9), torch.float64, dev, seed=4) if reduction == "none" else None
    out, got = loss_and_grads(lambda: lce(x, w, b, t, reduction=reduction, **kw), (x, w, b), g)
    want_out, want = loss_and_grads(lambda: lce_ref(x, w, b, t, reduction=reduction, **kw), (x, w, b), g)
    assert_close(out, want_out)
    for a, e in zip(got, want):
        assert_close(a, e, scale=10)


# ---- accuracy against float64: no worse than eager (x2) ----
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("options", ["plain", "all"])
def test_linear_accuracy_vs_float64(dev, dtype, reduction, options):
    x, w, b = lce_inputs((96,), 64, 300, dtype, dev)
    t = targets((96,), 300, dev)
    kw = dict(reduction=reduction)
    if options == "all":
        kw.update(ALL_OPTIONS, weight=class_weight(300, dtype, dev))
    g = make((96,), dtype, dev, low=0, high=2, seed=5) if reduction == "none" else None
    x64, w64, b64 = (a.detach().double().requires_grad_() for a in (x, w, b))
    kw64 = dict(kw, weight=kw["weight"].double()) if "weight" in kw else kw
    out, got = loss_and_grads(lambda: lce(x, w, b, t, **kw), (x, w, b), g)
    eager, eager_grads = loss_and_grads(lambda: lce_ref(x, w, b, t, **kw), (x, w, b), g)
    exact, exact_grads = loss_and_grads(
        lambda: lce_ref(x64, w64, b64, t, **kw64), (x64, w64, b64), None if g is None else g.double()
    )
    assert_accuracy(out, eager, exact)
    for a, e, r in zip(got, eager_grads, exact_grads):
        assert_accuracy(a, e, r)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_confident_prediction_true_class_gradient(dtype):
    """Liger PR #1329: the true class's gradient p_t - 1 of a confident prediction (p_t ~ 0.9, 0.99, 0.999) must
    not come from p_t rounded to 16 bits. Checked on fused.cross_entropy (fresh gradient buffer), on the row kernel
    writing the gradient over its 16-bit logits (what linear_cross_entropy does per chunk) and through the linear
    head; the relative error of the true-class entries against float64 is no worse than eager's (x2)."""
    V = 32000
    rows = []
    for p_t in (0.9, 0.99, 0.999):  # logit of the target so that its softmax is about p_t among V N(0,1) logits
        row = torch.randn(V, generator=torch.Generator().manual_seed(len(rows)), dtype=torch.float64)
        row[7] = math.log(p_t / (1 - p_t) * row.exp().sum().item())
        rows.append(row)
    logits64 = torch.stack(rows)
    logits = logits64.to(dtype)
    t = torch.full((3,), 7)
    x64 = logits.double().requires_grad_()
    exact = torch.autograd.grad(F.cross_entropy(x64, t, reduction="sum"), x64)[0][:, 7]
    xe = logits.clone().requires_grad_()
    eager = torch.autograd.grad(F.cross_entropy(xe, t, reduction="sum"), xe)[0][:, 7]
    xf = logits.clone().requires_grad_()
    ours = torch.autograd.grad(fused.cross_entropy(xf, t, reduction="sum"), xf)[0][:, 7]
    buf = logits.clone()
    torch.ops.fused.cross_entropy_rows(buf, t, None, torch.ones(2), buf, -100, 0.0, 0.0, 0.0)
    in_place = buf[:, 7]
    assert (exact < 0).all() and (exact > -0.2).all()
    for got in (ours, in_place):
        for i in range(3):
            assert (
                rel_error(got[i : i + 1], exact[i : i + 1]) <= 2 * rel_error(eager[i : i + 1], exact[i : i + 1]) + 1e-6
            )
    # through the linear head: input = one-hot rows, so the logits are linear_weight's columns
    w = logits.t().contiguous().requires_grad_()
    x = torch.eye(3, dtype=dtype)
    got = torch.autograd.grad(fused.linear_cross_entropy(x, w, t, reduction="sum"), w)[0][7]
    for i in range(3):
        assert rel_error(got[i : i + 1], exact[i : i + 1]) <= 2 * rel_error(eager[i : i + 1], exact[i : i + 1]) + 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_vocab(dtype):
    """V = 256k: no overflow (logits up to 100, exp(100) overflows float32) and no precision lost in the
    logsumexp (blocked sums; a common offset of 1000 costs nothing): loss and gradient against float64, no worse
    than eager; and through the linear head (4 rows, D = 8)."""
    V = 262144
    logits = make((4, V), torch.float64, low=-4, high=4, seed=1)
    logits[1] += 1000.0
    logits[2, :100] = 100.0
    logits = logits.to(dtype)
    t = torch.tensor([5, V - 1, 50, 123456])
    x64 = logits.double().requires_grad_()
    exact, exact_grad = loss_and_grads(
        lambda: F.cross_entropy(x64, t, reduction="none", label_smoothing=0.1),
        [x64],
        torch.ones(4, dtype=torch.float64),
    )
    xe = logits.clone().requires_grad_()
    eager, eager_grad = loss_and_grads(
        lambda: F.cross_entropy(xe, t, reduction="none", label_smoothing=0.1), [xe], torch.ones(4, dtype=dtype)
    )
    xf = logits.clone().requires_grad_()
    ours, ours_grad = loss_and_grads(
        lambda: fused.cross_entropy(xf, t, reduction="none", label_smoothing=0.1), [xf], torch.ones(4, dtype=dtype)
    )
    assert torch.isfinite(ours).all()
    assert_accuracy(ours, eager, exact)
    assert_accuracy(ours_grad[0], eager_grad[0], exact_grad[0])
    _, lse = torch.ops.fused.cross_entropy_rows(
        logits, t, None, torch.ones(2), logits.new_empty(0), -100, 0.0, 0.0, 0.0
    )
    assert (
        rel_error(lse, torch.logsumexp(logits.double(), 1))
        <= 2 * rel_error(torch.logsumexp(logits, 1), torch.logsumexp(logits.double(), 1)) + 1e-7
    )
    x, w, b = lce_inputs((4,), 8, V, dtype, seed=2)
    x64, w64, b64 = (a.detach().double().requires_grad_() for a in (x, w, b))
    out, got = loss_and_grads(lambda: lce(x, w, b, t, z_loss=1e-4), (x, w, b))
    eager, eager_grads = loss_and_grads(lambda: lce_ref(x, w, b, t, z_loss=1e-4), (x, w, b))
    exact, exact_grads = loss_and_grads(lambda: lce_ref(x64, w64, b64, t, z_loss=1e-4), (x64, w64, b64))
    assert_accuracy(out, eager, exact)
    for a, e, r in zip(got, eager_grads, exact_grads):
        assert_accuracy(a, e, r)


# ---- ignore_index, reductions, empty and special values ----
@pytest.mark.parametrize("ignore_index", [-100, -1, 3])
def test_all_targets_ignored(ignore_index):
    """torch's: mean is nan, sum is 0, none is zeros; every gradient is zero."""
    x, w, b = lce_inputs((16,), 8, 20)
    t = torch.full((16,), ignore_index)
    all_options = dict(ALL_OPTIONS, weight=class_weight(20))
    for reduction, kw in (("mean", {}), ("sum", {}), ("none", {}), ("mean", all_options)):
        g = torch.ones(16) if reduction == "none" else None
        out, got = loss_and_grads(
            lambda: lce(x, w, b, t, reduction=reduction, ignore_index=ignore_index, **kw), (x, w, b), g
        )
        want, want_grads = loss_and_grads(
            lambda: lce_ref(x, w, b, t, reduction=reduction, ignore_index=ignore_index, **kw), (x, w, b), g
        )
        torch.testing.assert_close(out, want, equal_nan=True)
        assert out.isnan().all() if reduction == "mean" else (out == 0).all()
        for a, e in zip(got, want_grads):
            assert torch.equal(a, e) and not a.any()


@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
def test_zero_class_weight_sum_mean_is_nan(label_smoothing):
    """torch: a "mean" whose targets' class weights sum to 0 is nan (0 / 0), with label smoothing too."""
    x, w, b = lce_inputs((6,), 8, 10)
    t = torch.tensor([3, 3, -100, 3, 3, 3])
    cw = class_weight(10)
    cw[3] = 0
    kw = dict(weight=cw, label_smoothing=label_smoothing)
    out, got = loss_and_grads(lambda: lce(x, w, b, t, **kw), (x, w, b))
    want, want_grads = loss_and_grads(lambda: F.cross_entropy(F.linear(x, w, b), t, **kw), (x, w, b))
    assert want.isnan() and out.isnan()
    for a, e in zip(got, want_grads):
        torch.testing.assert_close(a, e, equal_nan=True)
    logits = make((6, 10), seed=2)
    assert fused.cross_entropy(logits, t, **kw).isnan()


@needs_torch_linear_cross_entropy
def test_ignore_index_inside_class_range_and_none():
    """An ignore_index that is also a valid class (Liger: 2, 42), and ignore_index=None meaning -100 (torch)."""
    x, w, b = lce_inputs((40,), 12, 50)
    t = targets((40,), 50, ignore_index=42)
    t[1] = 2
    for ii in (2, 42):
        for kw in ({}, dict(label_smoothing=0.2), dict(ALL_OPTIONS, weight=class_weight(50))):
            out, got = loss_and_grads(lambda: lce(x, w, b, t, ignore_index=ii, **kw), (x, w, b))
            want, want_grads = loss_and_grads(lambda: lce_ref(x, w, b, t, ignore_index=ii, **kw), (x, w, b))
            assert_close(out, want, scale=10)
            for a, e in zip(got, want_grads):
                assert_close(a, e, scale=10)
    t = targets((40,), 50)
    assert torch.equal(lce(x, w, b, t, ignore_index=None), lce(x, w, b, t))
    assert_close(lce(x, w, b, t, ignore_index=None), F.linear_cross_entropy(x, w, t, linear_bias=b), scale=10)


def test_empty_batch():
    x, w, b = lce_inputs((0,), 8, 20)
    t = torch.zeros(0, dtype=torch.long)
    out, got = loss_and_grads(lambda: lce(x, w, b, t), (x, w, b))
    assert out.isnan()  # torch: mean over no rows
    assert got[0].shape == (0, 8) and not got[1].any() and not got[2].any()
    assert lce(x, w, b, t, reduction="sum").item() == 0.0
    assert lce(x, w, b, t, reduction="none").shape == (0,)


def test_nan_and_inf_propagate_as_eager():
    x, w, b = lce_inputs((6,), 8, 20, requires_grad=False)
    x[2, 3] = float("nan")
    b[4] = float("-inf")  # a class no row can predict: fine unless it is a target
    t = targets((6,), 20)
    t[3] = 4
    out, want = lce(x, w, b, t, reduction="none"), lce_ref(x, w, b, t, reduction="none")
    assert out[2].isnan() and out[3] == float("inf")
    torch.testing.assert_close(out, want, equal_nan=True, rtol=2e-5, atol=2e-5)
    assert lce(x, w, b, t).isnan()
    # masked (-inf) logits: harmless without label smoothing, an inf loss with it (log p = -inf), as eager
    logits = make((3, 40), seed=4)
    logits[:, :10] = float("-inf")
    t = torch.tensor([12, 20, 39])
    for ls in (0.0, 0.1):
        out, want = (f(logits, t, reduction="none", label_smoothing=ls) for f in (fused.cross_entropy, F.cross_entropy))
        torch.testing.assert_close(out, want)
        assert torch.isfinite(out).all() == (ls == 0)


def test_noncontiguous_inputs():
    """Strided input, a transposed linear_weight (e.g. a [D, V] parameter used as .t()), strided bias and
    target, and a 1-D input with a 0-d target."""
    x, w, b = lce_inputs((10,), 16, 24, requires_grad=False)
    t = targets((10,), 24)
    xs, bs, ts = noncontiguous(x), noncontiguous(b), t.repeat_interleave(2)[::2]
    ws = w.t().contiguous().t()
    assert not (xs.is_contiguous() or ws.is_contiguous() or bs.is_contiguous() or ts.is_contiguous())
    for leaf in (xs, ws, bs):
        leaf.requires_grad_()
    out, got = loss_and_grads(lambda: lce(xs, ws, bs, ts, **ALL_OPTIONS), (xs, ws, bs))
    want, want_grads = loss_and_grads(lambda: lce_ref(xs, ws, bs, ts, **ALL_OPTIONS), (xs, ws, bs))
    assert_close(out, want, scale=10)
    for a, e in zip(got, want_grads):
        assert_close(a, e, scale=10)
    one = lce(x[0], w, b, t[0], reduction="none")
    assert one.shape == () and torch.isfinite(one)
    assert_close(one, lce_ref(x[0], w, b, t[0], reduction="none"), scale=10)


def test_uint8_target_and_no_grad():
    x, w, b = lce_inputs((12,), 8, 20)
    t = torch.randint(0, 20, (12,))
    assert torch.equal(lce(x, w, b, t.to(torch.uint8)), lce(x, w, b, t))
    with torch.no_grad():
        out = lce(x, w, b, t)
    assert not out.requires_grad
    assert torch.equal(out, lce(x, w, b, t).detach())


@needs_torch_linear_cross_entropy
def test_autocast():
    """Under autocast (bf16 hidden states, an fp32 head): the GEMMs in bf16 and a float32 loss, as torch's
    F.linear_cross_entropy; loss and gradients no worse than torch's against float64 (x2)."""
    x, w, b = lce_inputs((64,), 32, 200, seed=9)
    t = targets((64,), 200)
    x64, w64, b64 = (a.detach().bfloat16().double().requires_grad_() for a in (x, w, b))
    exact, exact_grads = loss_and_grads(lambda: lce_ref(x64, w64, b64, t, label_smoothing=0.1), (x64, w64, b64))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, got = loss_and_grads(lambda: lce(x.bfloat16(), w, b, t, label_smoothing=0.1), (x, w, b))
        want, want_grads = loss_and_grads(
            lambda: F.linear_cross_entropy(x.bfloat16(), w, t, linear_bias=b, label_smoothing=0.1), (x, w, b)
        )
        logits = make((8, 20), seed=3, requires_grad=True)
        assert fused.cross_entropy(logits.bfloat16(), t[:8].clamp(0, 19)).dtype == torch.float32
    assert out.dtype == want.dtype == torch.float32
    assert_accuracy(out, want, exact)
    for a, e, r in zip(got, want_grads, exact_grads):
        assert a.dtype == e.dtype
        assert_accuracy(a, e, r)


def test_not_last_layer_and_backward():
    """Liger's "not last layer": a loss scaled after the op (grad_output 3) through .backward() into .grad."""
    x, w, b = lce_inputs((20,), 8, 30)
    t = targets((20,), 30)
    (3 * lce(x, w, b, t, **ALL_OPTIONS)).backward()
    got = [p.grad.clone() for p in (x, w, b)]
    for p in (x, w, b):
        p.grad = None
    (3 * lce_ref(x, w, b, t, **ALL_OPTIONS)).backward()
    for a, p in zip(got, (x, w, b)):
        assert_close(a, p.grad, scale=10)


def test_second_backward():
    """mean/sum compute the gradients in forward and the first backward consumes them; a second backward through
    the same graph (retain_graph) recomputes them, as "none" always does: the same results."""
    x, w, b = lce_inputs((8,), 8, 12)
    t = targets((8,), 12)
    for reduction in ("mean", "sum", "none"):
        loss = lce(x, w, b, t, reduction=reduction, **ALL_OPTIONS).sum()
        first = torch.autograd.grad(loss, (x, w, b), retain_graph=True)
        second = torch.autograd.grad(loss, (x, w, b))
        for a, c in zip(first, second):
            assert_close(a, c)
    logits = make((6, 12), requires_grad=True)
    loss = fused.cross_entropy(logits, t[:6])
    first = torch.autograd.grad(2 * loss, logits, retain_graph=True)[0]
    assert_close(torch.autograd.grad(2 * loss, logits)[0], first)


def test_deterministic():
    """The row kernel gives the same bits whatever the thread count (each row is one thread's, start to end); the
    whole op the same bits run after run (ATen's GEMMs, like eager's, may round differently per thread count)."""
    logits = make((70, 150), low=-4, high=4, seed=1)
    t = targets((70,), 150)
    scale = make((70, 2), low=0.5, high=2, seed=2)
    runs = []
    old = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            grad = torch.empty_like(logits)
            runs.append(
                (
                    *torch.ops.fused.cross_entropy_rows(
                        logits, t, class_weight(150), scale, grad, -100, 0.1, 1e-2, 4.0
                    ),
                    grad,
                )
            )
    finally:
        torch.set_num_threads(old)
    assert all(torch.equal(a, c) for a, c in zip(*runs))
    x, w, b = lce_inputs((70,), 24, 150)
    first, again = (loss_and_grads(lambda: lce(x, w, b, t, **ALL_OPTIONS), (x, w, b)) for _ in range(2))
    assert torch.equal(first[0], again[0]) and all(torch.equal(a, c) for a, c in zip(first[1], again[1]))


def test_only_some_gradients():
    """A frozen head (only input needs a gradient) or frozen input: the other GEMMs are skipped, the results are
    those of the full run."""
    x, w, b = lce_inputs((20,), 8, 30)
    t = targets((20,), 30)
    full = torch.autograd.grad(lce(x, w, b, t), (x, w, b))
    assert torch.equal(torch.autograd.grad(lce(x, w.detach(), b.detach(), t), x)[0], full[0])
    gw, gb = torch.autograd.grad(lce(x.detach(), w, b, t), (w, b))
    assert torch.equal(gw, full[1]) and torch.equal(gb, full[2])


def test_memory_without_the_logits(monkeypatch):
    """fwd+bwd peak memory: no N x V logits, a quarter of eager's or less, and within the gradients plus a chunk."""
    from benchmarks.timing import peak_memory_mb

    monkeypatch.setattr(chunked, "CHUNK_BYTES", 2**20)
    x, w, b = lce_inputs((1024,), 32, 4096)
    t = targets((1024,), 4096)

    def fwd_bwd(fn):
        return lambda: torch.autograd.grad(fn(), (x, w, b))

    ours = peak_memory_mb(fwd_bwd(lambda: lce(x, w, b, t)), "cpu")
    eager = peak_memory_mb(fwd_bwd(lambda: lce_ref(x, w, b, t)), "cpu")
    grads_mb = (x.numel() + w.numel() + b.numel()) * 4 / 2**20
    assert ours <= eager / 4, (ours, eager)
    assert ours <= grads_mb + 1.0 + 0.5, (ours, grads_mb)  # + one chunk of logits (1 MiB) + small vectors


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("upcast", [False, True])
def test_16bit_gemm_paths(monkeypatch, dtype, upcast):
    """Both ways the CPU runs 16-bit chunks (chunked.gemm_dtype), whichever this machine takes: 16-bit GEMMs, or
    float32 GEMMs on operands upcast a slice of classes at a time (CPUs without AVX512-BF16 / AMX). Several chunks
    and class slices; the loss and every gradient within eager's error of float64, in the input's dtype."""
    monkeypatch.setattr(chunked, "gemm_dtype", lambda t: torch.float32 if upcast and t.dtype == dtype else t.dtype)
    monkeypatch.setattr(chunked, "CHUNK_BYTES", 4096)  # 8 rows of fp32 logits a chunk; 32 classes a slice
    monkeypatch.setattr(chunked, "SUM_ELEMENTS", 900)  # the bias gradient 3 rows at a time
    x, w, b = lce_inputs((45,), 32, 300, dtype)
    t = targets((45,), 300)
    upstream = make((45,), dtype, seed=9)
    loss = lce(x, w, b, t, reduction="none")
    got = (loss, *torch.autograd.grad((loss * upstream).sum(), (x, w, b)))
    eager_loss = lce_ref(x, w, b, t, reduction="none")
    eager = (eager_loss, *torch.autograd.grad((eager_loss * upstream).sum(), (x, w, b)))
    x64, w64, b64 = (v.detach().double().requires_grad_() for v in (x, w, b))
    loss64 = lce_ref(x64, w64, b64, t, reduction="none")
    exact = (loss64, *torch.autograd.grad((loss64 * upstream.double()).sum(), (x64, w64, b64)))
    for ours, e, r in zip(got, eager, exact):
        assert ours.dtype == e.dtype
        assert_accuracy(ours.float(), e.float(), r)


def test_memory_upcast_small_weight(monkeypatch):
    """The float32-GEMM path's upcast buffer is sized by the weight when the weight is smaller than a slice's budget
    (CHUNK_BYTES, 64 MiB): a small 16-bit head peaks at kilobytes, not at the budget."""
    from benchmarks.timing import peak_memory_mb

    monkeypatch.setattr(chunked, "gemm_dtype", lambda t: torch.float32)
    monkeypatch.setattr(chunked, "CHUNK_BYTES", 64 * 2**20)  # the library's budget (the suite's chunks are small)
    x, w, b = lce_inputs((64,), 32, 100, torch.bfloat16)
    t = targets((64,), 100)
    ours = peak_memory_mb(lambda: torch.autograd.grad(lce(x, w, b, t), (x, w, b)), "cpu")
    assert ours < 0.5, ours  # the weight, its float32 copy and gradient, 64 x 100 float32 logits: about 0.1 MB


@pytest.mark.parametrize("upcast", [False, True])
def test_memory_16bit_weight_gradient(monkeypatch, upcast):
    """bf16: the weight gradient accumulates in fp32 (2 weight sizes) and a chunk may take one weight size (fewer
    fp32 additions): the input's gradient, the accumulator and one chunk, never the N x V logits; the chunk is freed
    before the accumulator is rounded into the bf16 weight gradient, which takes its place. Both of the CPU's GEMM
    paths (chunked.gemm_dtype): bf16 GEMMs, or float32 GEMMs over operands upcast a slice at a time."""
    from benchmarks.timing import peak_memory_mb

    monkeypatch.setattr(
        chunked, "gemm_dtype", lambda t: torch.float32 if upcast and t.dtype != torch.float64 else t.dtype
    )
    monkeypatch.setattr(chunked, "SUM_ELEMENTS", 4096)  # the bias gradient's float32 rows: one at a time (16 KiB)

    monkeypatch.setattr(chunked, "CHUNK_BYTES", 2**18)
    x, w, b = lce_inputs((2048,), 32, 4096, torch.bfloat16)
    t = targets((2048,), 4096)
    assert chunked.chunk_rows(2048, w, True) == 32 and chunked.chunk_rows(2048, w) == 32  # 256 KiB: 32 rows
    monkeypatch.setattr(chunked, "CHUNK_BYTES", 2**14)
    assert chunked.chunk_rows(2048, w, True) == 32 and chunked.chunk_rows(2048, w) == 8  # the weight's size
    ours = peak_memory_mb(lambda: torch.autograd.grad(lce(x, w, b, t), (x, w, b)), "cpu")
    eager = peak_memory_mb(lambda: torch.autograd.grad(lce_ref(x, w, b, t), (x, w, b)), "cpu")
    weight_mb = w.numel() * 2 / 2**20
    grads_mb = (x.numel() + w.numel() + b.numel()) * 2 / 2**20
    # torch's own GEMM may take scratch beyond its output: a bf16 one that goes to oneDNN (CPUs with AVX512-BF16)
    # packs the weight-sized operand; none elsewhere. Measured on the loop's GEMMs: its chunk rows, its GEMM dtype.
    gemm = chunked.gemm_dtype(x)
    rows = chunked.chunk_rows(2048, w, gemm != torch.float32, gemm)
    xg, wg = x.detach()[:rows].to(gemm), w.detach().to(gemm)
    logits = torch.ones(rows, w.shape[0], dtype=gemm)
    gemms = (lambda: xg @ wg.T, lambda: logits @ wg, lambda: logits.T @ xg)
    outputs_mb = [n * logits.element_size() / 2**20 for n in (logits.numel(), xg.numel(), wg.numel())]
    gemm_scratch_mb = max(peak_memory_mb(g, "cpu") - out for g, out in zip(gemms, outputs_mb))
    # grads_mb counts the bf16 weight gradient: the chunk's weight size in the loop, its own at the end (+ the
    # class slices' 16-bit part, 8 KiB, and per-row vectors)
    assert ours <= grads_mb + 2 * weight_mb + max(gemm_scratch_mb, 0.0) + 0.1, (
        ours,
        grads_mb,
        weight_mb,
        gemm_scratch_mb,
    )
    assert ours <= eager / 4, (ours, eager)


# ---- fused.cross_entropy (given logits) ----
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_parity_and_accuracy(dev, dtype, reduction):
    logits = make((45, 77), dtype, dev, low=-4, high=4, seed=1, requires_grad=True)
    t = targets((45,), 77, dev)
    kw = dict(ALL_OPTIONS, reduction=reduction, weight=class_weight(77, dtype, dev))
    g = make((45,), dtype, dev, seed=2) if reduction == "none" else None
    out, got = loss_and_grads(lambda: fused.cross_entropy(logits, t, **kw), [logits], g)
    want, want_grad = loss_and_grads(lambda: ref.cross_entropy(logits, t, **kw), [logits], g)
    assert_close(out, want, scale=2)
    assert_close(got[0], want_grad[0], scale=2)
    if dtype != torch.float64:
        x64 = logits.detach().double().requires_grad_()
        kw64 = dict(kw, weight=kw["weight"].double())
        exact, exact_grad = loss_and_grads(
            lambda: ref.cross_entropy(x64, t, **kw64), [x64], None if g is None else g.double()
        )
        assert_accuracy(out, want, exact)
        assert_accuracy(got[0], want_grad[0], exact_grad[0])


def test_cross_entropy_shapes_as_torch():
    """(C) with a 0-d target, (N, C), and (N, C, d1, d2) with classes on dim 1, strided logits."""
    cases = [
        (make((9,), seed=1), torch.tensor(4)),
        (noncontiguous(make((6, 9), seed=2)), torch.arange(6)),
        (make((3, 9, 4, 2), seed=3), torch.randint(0, 9, (3, 4, 2))),
    ]
    for logits, t in cases:
        for reduction in ("mean", "none"):
            x = logits.detach().requires_grad_()
            out, got = loss_and_grads(
                lambda: fused.cross_entropy(x, t, reduction=reduction, z_loss=1e-3),
                [x],
                torch.ones(t.shape) if reduction == "none" else None,
            )
            want, want_grad = loss_and_grads(
                lambda: ref.cross_entropy(x, t, reduction=reduction, z_loss=1e-3),
                [x],
                torch.ones(t.shape) if reduction == "none" else None,
            )
            assert out.shape == want.shape
            assert_close(out, want, scale=2)
            assert_close(got[0], want_grad[0], scale=2)


def test_bfloat16_matches_float32_internals():
    """Liger's float32-internal test: bf16 logits give the loss of their float32 copy (math in float32), and the
    gradient of that copy rounded once."""
    logits = make((4, 3000), torch.bfloat16, seed=5)
    t = torch.randint(0, 3000, (4,))
    x16, x32 = logits.clone().requires_grad_(), logits.float().requires_grad_()
    out16, g16 = loss_and_grads(
        lambda: fused.cross_entropy(x16, t, reduction="none"), [x16], torch.ones(4, dtype=torch.bfloat16)
    )
    out32, g32 = loss_and_grads(lambda: fused.cross_entropy(x32, t, reduction="none"), [x32], torch.ones(4))
    assert torch.equal(out16, out32.bfloat16())
    assert torch.equal(g16[0], g32[0].bfloat16())


# ---- gradcheck and compile (opcheck: tests/op_registry.py's samples, run by test_op_coverage.py) ----
def test_gradcheck_float64():
    x, w, b = lce_inputs((3,), 5, 20, torch.float64)
    t = torch.tensor([1, -100, 19])
    cw = class_weight(20, torch.float64)
    for reduction in ("mean", "none"):
        for kw in ({}, dict(ALL_OPTIONS, weight=cw)):
            assert torch.autograd.gradcheck(lambda *a: lce(*a, t, reduction=reduction, **kw), (x, w, b))
    logits = make((4, 7), torch.float64, requires_grad=True)
    t = torch.tensor([0, 6, -100, 3])
    for reduction in ("mean", "none"):
        assert torch.autograd.gradcheck(
            lambda a: fused.cross_entropy(a, t, reduction=reduction, **ALL_OPTIONS), (logits,)
        )


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_compile_fullgraph(reduction):
    x, w, b = lce_inputs((2, 6), 8, 20)
    t = targets((2, 6), 20)
    check_compile(lambda *a: lce(*a, t, reduction=reduction, **ALL_OPTIONS), x.detach(), w.detach(), b.detach())
    torch._dynamo.reset()

    def loss(x, w, b):
        return lce(x, w, b, t, reduction=reduction, **ALL_OPTIONS).sum() * 2

    got = torch.autograd.grad(torch.compile(loss, fullgraph=True)(x, w, b), (x, w, b))
    want = torch.autograd.grad(lce_ref(x, w, b, t, reduction=reduction, **ALL_OPTIONS).sum() * 2, (x, w, b))
    for a, e in zip(got, want):
        assert_close(a, e, scale=10)
    logits = make((12, 20), requires_grad=True)
    torch._dynamo.reset()
    got = torch.autograd.grad(
        torch.compile(lambda a: fused.cross_entropy(a, t.view(-1), reduction=reduction).sum(), fullgraph=True)(logits),
        logits,
    )[0]
    want = torch.autograd.grad(ref.cross_entropy(logits, t.view(-1), reduction=reduction).sum(), logits)[0]
    assert_close(got, want, scale=2)


# ---- bad input ----
def test_errors_name_op_and_argument():
    x, w, b = lce_inputs((4,), 8, 10, requires_grad=False)
    t = torch.tensor([1, 2, 3, 4])
    op = "fused.linear_cross_entropy"
    with raises(f"{op}: reduction must be 'none', 'mean' or 'sum', got 'avg'"):
        lce(x, w, b, t, reduction="avg")
    for ls in (-0.1, 1.1):
        with raises(f"{op}: label_smoothing must be in"):
            lce(x, w, b, t, label_smoothing=ls)
    with raises(f"{op}: softcap must be > 0"):
        lce(x, w, b, t, softcap=0.0)
    with raises(f"{op}: z_loss must be >= 0"):
        lce(x, w, b, t, z_loss=-1.0)
    with raises(f"{op}: a class-probability target \\(floating point\\) must have the logits' shape \\(4, 10\\)"):
        lce(x, w, b, torch.rand(4, 9))
    with raises(f"{op}: ignore_index cannot be given with class-probability targets"):
        lce(x, w, b, torch.rand(4, 10), ignore_index=1)
    with raises("fused.cross_entropy: ignore_index is not supported with class-probability targets"):
        fused.cross_entropy(make((4, 10)), torch.rand(4, 10), ignore_index=1)
    with raises(f"{op}: target must hold int64 \\(or uint8\\) class indices, got torch.int32"):
        lce(x, w, b, t.int())
    with raises(f"{op}: target must have shape \\(4,\\)"):
        lce(x, w, b, t[:3])
    with pytest.raises(IndexError, match=f"{op}: target 10 is out of bounds for 10 classes"):
        lce(x, w, b, torch.tensor([1, 10, 3, 4]))
    with pytest.raises(IndexError, match="fused.cross_entropy: target -5 is out of bounds"):
        fused.cross_entropy(make((4, 10)), torch.tensor([1, -5, 3, 4]))
    with pytest.raises(IndexError, match="fused.cross_entropy: target 1 is out of bounds for 0 classes"):
        fused.cross_entropy(make((4, 0)), torch.tensor([1, -100, 3, 4]))
    with pytest.raises(IndexError, match=f"{op}: target 1 is out of bounds for 0 classes"):
        lce(x, w[:0], b[:0], t)
    with raises(f"{op}: linear_weight has in_features 7 but input has 8"):
        lce(x, w[:, :7], b, t)
    with raises(f"{op}: a K-dimensional linear_weight of shape \\(5, 2, 8\\) needs input of shape \\[N, 8\\]"):
        lce(x[0], w.view(5, 2, 8), None, t[0])
    with raises(f"{op}: linear_weight must be \\[classes, in_features\\] .*got shape \\(80,\\)"):
        lce(x, w.flatten(), None, t)
    with raises(f"{op}: linear_bias must have shape \\(5, 2\\)"):
        lce(x, w.view(5, 2, 8), b, t)
    with raises(f"{op}: target must have shape \\(4, 2\\)"):
        lce(x, w.view(5, 2, 8), None, t)
    with raises(f"{op}: linear_bias must be 1-D with 10 entries"):
        lce(x, w, b[:9], t)
    with raises(f"{op}: linear_weight has dtype torch.float64 but input has dtype torch.float32"):
        lce(x, w.double(), b, t)
    with raises(f"{op}: linear_weight is on meta but input is on cpu"):
        lce(x, w.to("meta"), b, t)
    with raises(f"{op}: target is on meta but the logits are on cpu"):
        lce(x, w, b, t.to("meta"))
    with raises(f"{op}: weight must be 1-D with 10 entries"):
        lce(x, w, b, t, weight=torch.ones(9))
    with raises(f"{op}: input must be a floating-point tensor"):
        lce(x.long(), w.long(), None, t)
    with raises("fused.cross_entropy: logits must have at least 1 dimension"):
        fused.cross_entropy(torch.tensor(1.0), torch.tensor(0))
    with raises("fused.cross_entropy: target must have shape \\(4, 3\\)"):
        fused.cross_entropy(make((4, 10, 3)), torch.zeros(4, 10, dtype=torch.long))
    with raises("fused.nn.FusedLinearCrossEntropyLoss: reduction must be"):
        fused.nn.FusedLinearCrossEntropyLoss(reduction="avg")
    # the C++ kernel checks its own arguments, naming op and argument
    with raises("fused.cross_entropy_rows: scale must have shape \\[2\\] or \\[rows, 2\\]"):
        torch.ops.fused.cross_entropy_rows(make((4, 10)), t, None, torch.ones(3), torch.empty(0), -100, 0.0, 0.0, 0.0)
    with raises("fused.cross_entropy_rows: target must be int64 class indices"):
        torch.ops.fused.cross_entropy_rows(
            make((4, 10)), t.int(), None, torch.ones(2), torch.empty(0), -100, 0.0, 0.0, 0.0
        )


# ---- class-probability targets and K-dimensional linear weights: whole logits, as torch's chunked path ----
@needs_torch_linear_cross_entropy
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_probability_targets_and_k_dimensional_weight(reduction):
    """torch 2.13's F.linear_cross_entropy (and F.cross_entropy) take class-probability targets (a float target of
    the logits' shape, which gets a gradient too) and linear_weight [C, d1, ..., D] with linear_bias [C, d1, ...]
    (logits [N, C, d1, ...]): with class weights, label smoothing, a bias, leading input dims; z_loss and softcap
    as the reference defines them."""
    x, w, b = lce_inputs((6,), 5, 7, torch.float64)
    cw = class_weight(7, torch.float64)
    probs = make((6, 7), torch.float64, low=0, high=1, seed=5).softmax(-1).requires_grad_()
    wk = make((7, 2, 3, 5), torch.float64, low=-1, high=1, seed=6, requires_grad=True)
    bk = make((7, 2, 3), torch.float64, seed=7, requires_grad=True)
    tk = targets((6, 2, 3), 7)
    g = make((6,) if reduction == "none" else (), torch.float64, seed=8)
    cases = [
        ((x, w, probs), dict(linear_bias=b, weight=cw, label_smoothing=0.2), (x, w, b, probs)),
        ((x, wk, tk), dict(linear_bias=bk, weight=cw, label_smoothing=0.1), (x, wk, bk)),
        ((x, wk, targets((6, 2, 3), 7, ignore_index=2)), dict(ignore_index=2), (x, wk)),
    ]
    for args, kw, leaves in cases:
        gk = g if args[2].dim() == 2 or reduction != "none" else g[:, None, None].expand(6, 2, 3)
        out, got = loss_and_grads(lambda: fused.linear_cross_entropy(*args, reduction=reduction, **kw), leaves, gk)
        want, want_grads = loss_and_grads(lambda: F.linear_cross_entropy(*args, reduction=reduction, **kw), leaves, gk)
        assert out.shape == want.shape
        assert_close(out, want)
        for a, e in zip(got, want_grads):
            assert_close(a, e)
        extended = dict(kw, z_loss=1e-2, softcap=3.0)
        ref_kw = {k: v for k, v in extended.items() if k != "linear_bias"}
        out, got = loss_and_grads(
            lambda: fused.linear_cross_entropy(*args, reduction=reduction, **extended), leaves, gk
        )
        want, want_grads = loss_and_grads(
            lambda: lce_ref(*args[:2], kw.get("linear_bias"), args[2], reduction=reduction, **ref_kw), leaves, gk
        )
        assert_close(out, want)
        for a, e in zip(got, want_grads):
            assert_close(a, e)
    # leading input dims with probability targets; fused.cross_entropy with probability targets
    x3 = x.detach().view(2, 3, 5)
    p3 = probs.detach().view(2, 3, 7)
    assert_close(lce(x3, w, b, p3, reduction=reduction), lce_ref(x3, w, b, p3, reduction=reduction))
    logits = make((6, 7, 2), torch.float64, seed=9)
    p = make((6, 7, 2), torch.float64, low=0, high=1, seed=10)
    for kw in (dict(weight=cw, label_smoothing=0.3), dict(z_loss=1e-2, softcap=2.0)):
        assert_close(
            fused.cross_entropy(logits, p, reduction=reduction, **kw),
            ref.cross_entropy(logits, p, reduction=reduction, **kw),
        )


@needs_torch_linear_cross_entropy
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_torch_opinfo_samples(dtype):
    """Every sample of torch's OpInfos "nn.functional.cross_entropy" and "nn.functional.linear_cross_entropy"
    (torch.testing._internal.common_methods_invocations.op_db, all variants, `options` left out): loss and the
    gradient of every input (the probability target's too) no worse than torch's against float64 (x2)."""
    pytest.importorskip("expecttest")  # torch.testing._internal imports it (make setup installs it)
    from torch.testing._internal.common_methods_invocations import op_db

    ours = {"nn.functional.cross_entropy": fused.cross_entropy, "nn.functional.linear_cross_entropy": lce_kw}

    def run(fn, args, kw):
        out = fn(*args, **kw)
        leaves = [a for a in (*args, *kw.values()) if isinstance(a, torch.Tensor) and a.requires_grad]
        return (out, *torch.autograd.grad(out, leaves, torch.ones_like(out)))

    def exact(a):
        floating = isinstance(a, torch.Tensor) and a.is_floating_point()
        return a.detach().double().requires_grad_(a.requires_grad) if floating else a

    count = 0
    for info in (o for o in op_db if o.name in ours):
        for sample in info.sample_inputs("cpu", dtype, requires_grad=True):
            args, kw = (sample.input, *sample.args), {k: v for k, v in sample.kwargs.items() if k != "options"}
            got = run(ours[info.name], args, kw)
            eager = run(info.op, args, kw)
            exact64 = run(info.op, [exact(a) for a in args], {k: exact(v) for k, v in kw.items()})
            for a, e, r in zip(got, eager, exact64):
                assert a.dtype == e.dtype and a.shape == e.shape
                assert_accuracy(a, e, r, what=f"{info.name} {info.variant_test_name} {sample.summary()}")
            count += 1
    assert count > 300


def lce_kw(input, linear_weight, target, **kw):
    return fused.linear_cross_entropy(input, linear_weight, target, **kw)


# ---- the module ----
def test_module_matches_functional():
    x, w, b = lce_inputs((2, 7), 8, 30)
    t = targets((2, 7), 30, ignore_index=3)
    loss_fn = fused.nn.FusedLinearCrossEntropyLoss(
        reduction="sum", ignore_index=3, label_smoothing=0.1, z_loss=1e-4, softcap=20.0
    )
    assert "z_loss=0.0001" in repr(loss_fn) and not list(loss_fn.parameters())
    got = loss_fn(x, w, t, b)
    want = lce(x, w, b, t, reduction="sum", ignore_index=3, label_smoothing=0.1, z_loss=1e-4, softcap=20.0)
    assert torch.equal(got, want)


# ---- ported from torch's test_linear_cross_entropy.py ----
@needs_torch_linear_cross_entropy
def test_torch_forward_backward_3d_input_large_vocab():
    x, w, b = lce_inputs((2, 3), 32, 6000, seed=11)
    t = torch.randint(0, 6000, (2, 3), generator=torch.Generator().manual_seed(0))
    out, got = loss_and_grads(lambda: lce(x, w, b, t), (x, w, b))
    # (torch 2.13's F.linear_cross_entropy takes 1-D or 2-D input; ours any [..., D])
    want, want_grads = loss_and_grads(
        lambda: F.linear_cross_entropy(x.flatten(0, 1), w, t.flatten(), linear_bias=b), (x, w, b)
    )
    assert_close(out, want, scale=10)
    for a, e in zip(got, want_grads):
        assert_close(a, e, scale=10)


@needs_torch_linear_cross_entropy
def test_torch_many_chunks_and_reductions_with_smoothing():
    x, w, _ = lce_inputs((1500,), 8, 64, seed=12)
    t = torch.randint(0, 64, (1500,), generator=torch.Generator().manual_seed(1))
    out, got = loss_and_grads(lambda: lce(x, w, None, t), (x, w))
    want, want_grads = loss_and_grads(lambda: F.linear_cross_entropy(x, w, t), (x, w))
    assert_close(out, want, scale=10)
    for a, e in zip(got, want_grads):
        assert_close(a, e, scale=20)
    x, w, b = lce_inputs((3, 4), 8, 16, seed=13)
    t = targets((3, 4), 16, ignore_index=-1)
    for reduction in ("none", "sum", "mean"):
        for ls in (0.0, 0.2):
            kw = dict(reduction=reduction, label_smoothing=ls, ignore_index=-1)
            g = torch.ones(3, 4) if reduction == "none" else None
            out, got = loss_and_grads(lambda: lce(x, w, b, t, **kw), (x, w, b), g)
            want, want_grads = loss_and_grads(
                lambda: F.linear_cross_entropy(x.flatten(0, 1), w, t.flatten(), linear_bias=b, **kw).view(out.shape),
                (x, w, b),
                g,
            )
            assert out.shape == want.shape
            assert_close(out, want, scale=10)
            for a, e in zip(got, want_grads):
                assert_close(a, e, scale=10)


# ---- the Triton launcher, under the interpreter on CPU where no GPU is present ----
@requires_triton
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy's notes on inf arithmetic under the interpreter
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("options", ["plain", "all"])
def test_triton_rows_match_cpu_kernel(dtype, options):
    from fused.loss import triton_kernels

    device = "cuda" if HAS_CUDA else "cpu"
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    logits = make((7, 300), dtype, low=-5, high=5, seed=1)
    t = targets((7,), 300)
    cw = class_weight(300, acc) if options == "all" else None
    kw = (
        dict(label_smoothing=0.1, z_loss=1e-2, softcap=4.0)
        if options == "all"
        else dict(label_smoothing=0.0, z_loss=0.0, softcap=0.0)
    )
    scale = make((7, 2), acc, low=0.5, high=2, seed=2)
    want_grad = torch.empty_like(logits)
    want = torch.ops.fused.cross_entropy_rows(logits, t, cw, scale, want_grad, -100, *kw.values())
    grad = torch.empty_like(logits, device=device)
    got = triton_kernels.cross_entropy_rows(
        logits.to(device),
        t.to(device),
        None if cw is None else cw.to(device),
        scale.to(device),
        grad,
        -100,
        *kw.values(),
    )
    for a, e in zip(got, want):
        assert a.dtype == acc
        assert_close(a.cpu(), e, scale=4)
    assert_close(grad.cpu(), want_grad, scale=4)
    # in place over the logits (how linear_cross_entropy calls it), and no gradient at all
    buf = logits.clone().to(device)
    triton_kernels.cross_entropy_rows(
        buf, t.to(device), None if cw is None else cw.to(device), scale.to(device), buf, -100, *kw.values()
    )
    assert_close(buf.cpu(), want_grad, scale=4)
    loss, lse = triton_kernels.cross_entropy_rows(
        logits.to(device),
        t.to(device),
        None,
        torch.ones(2, dtype=acc, device=device),
        logits.new_empty(0, device=device),
        -100,
        0.0,
        0.0,
        0.0,
    )
    assert_close(lse.cpu(), torch.where(t != -100, torch.logsumexp(logits.to(acc), 1), 0), scale=4)


@requires_triton
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_triton_confident_prediction_and_bad_target():
    """On TRITON_DEVICE (the GPU, else CPU tensors under the interpreter)."""
    from fused.loss import triton_kernels

    d = TRITON_DEVICE
    logits = torch.randn(2, 500, generator=torch.Generator().manual_seed(0))
    logits[:, 3] = math.log(0.999 / 0.001 * logits.exp().sum(1).mean().item())
    t = torch.tensor([3, 3])
    buf = logits.bfloat16().to(d)
    x64 = buf.cpu().double().requires_grad_()
    exact = torch.autograd.grad(F.cross_entropy(x64, t, reduction="sum"), x64)[0][:, 3]
    triton_kernels.cross_entropy_rows(buf, t.to(d), None, torch.ones(2, device=d), buf, -100, 0.0, 0.0, 0.0)
    assert rel_error(buf[:, 3].cpu(), exact) < 1e-2  # rounded once to bf16; p_t - 1 in bf16 would be off by ~100%
    logits, t = logits.to(d), t.to(d)
    bad_target = (torch.tensor([3, 500], device=d), None, torch.ones(2, device=d), logits.new_empty(0), -100, 0, 0, 0)
    if d == "cpu":
        with pytest.raises(IndexError, match="fused.cross_entropy_rows: target 500 is out of bounds for 500 classes"):
            triton_kernels.cross_entropy_rows(logits, *bad_target)
    else:  # a GPU checks no range on the host (that would sync): the row comes back NaN
        loss = triton_kernels.cross_entropy_rows(logits, *bad_target)[0]
        assert loss[1].isnan() and loss[0].isfinite()
    loss, lse = triton_kernels.cross_entropy_rows(
        logits[:0], t[:0], None, torch.ones(2, device=d), logits.new_empty(0), -100, 0.0, 0.0, 0.0
    )
    assert loss.shape == (0,) and lse.shape == (0,)
    # masked logits filling the whole first block of a row (the running max is -inf there), with and without
    # smoothing: the CPU kernel's (and eager's) results
    masked = make((2, 5000), seed=6)
    masked[0, :4096] = float("-inf")
    t = torch.tensor([4500, 7])
    for ls in (0.0, 0.1):
        got = triton_kernels.cross_entropy_rows(
            masked.to(d), t.to(d), None, torch.ones(2, device=d), masked.new_empty(0, device=d), -100, ls, 0.0, 0.0
        )[0]
        torch.testing.assert_close(got.cpu(), F.cross_entropy(masked, t, reduction="none", label_smoothing=ls))


@requires_triton
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_triton_no_classes_reads_nothing(monkeypatch):
    """V = 0 (an empty linear_weight) with targets that are not ignored, as a GPU runs it (no host-side range
    check): those rows get NaN, read from no address (an empty tensor's data pointer is null: a read faults)."""
    from fused.loss import triton_kernels

    monkeypatch.setattr(triton_kernels, "check_target_range", lambda *args: None)
    d = TRITON_DEVICE
    t = torch.tensor([0, -100, 5], device=d)
    for weight in (None, torch.empty(0, device=d)):
        logits = torch.empty(3, 0, device=d)
        loss, lse = triton_kernels.cross_entropy_rows(
            logits, t, weight, torch.ones(2, device=d), logits, -100, 0.1, 0.0, 0.0
        )
        for got in (loss, lse):
            got = got.cpu()
            assert got[[0, 2]].isnan().all() and got[1] == 0


@requires_triton
def test_triton_kernel_compiles_for_sm90():
    """The row kernel builds for sm_90 through its launcher (tests/triton_sm90.py: a stand-in sm_90 driver, compile
    only; the interpreter runs none of Triton's type checks or lowering): float32, bfloat16 and float64, with and
    without weights, smoothing, softcap and gradient; its softcap divisions correctly rounded (div.rn), none
    approximate."""
    import re

    stdout = compile_for_sm90(["loss"])
    stats = re.search(
        r"compiled _cross_entropy_rows_kernel: (\d+) variants, .* div.rn.f32 (\d+), div.full.f32 (\d+)", stdout
    )
    assert stats and int(stats[1]) == 6 and int(stats[2]) > 0 and int(stats[3]) == 0, stdout


# ---- the CUDA C++ row kernel, run on the CPU by the host emulation of CUDA (tests/cuda_emulation.py) ----
def emu_rows(emu, logits, target, weight, scale, grad, ignore_index, label_smoothing, z_loss, softcap, ld=None):
    """The CUDA launcher on guarded buffers (tests/test_cuda_emulation.py's), as the binding calls it: (loss, lse)."""
    rows, V = target.shape[0], logits.shape[-1]
    acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
    loss, lse = out((rows,), acc), out((rows,), acc)
    w_sum = None if weight is None else buf(weight.double().sum().reshape(1))
    launch(
        emu.cross_entropy_rows,
        cuda_emulation.code(logits.dtype),
        logits,
        ld or V,
        grad,
        V if grad is not None else 0,
        buf(target),
        None if weight is None else buf(weight),
        w_sum,
        buf(scale),
        2 if scale.dim() == 2 else 0,
        loss,
        lse,
        rows,
        V,
        ignore_index,
        label_smoothing,
        z_loss,
        softcap,
    )
    return loss, lse


requires_emulation = pytest.mark.skipif(
    cuda_emulation.unavailable() is not None, reason=str(cuda_emulation.unavailable())
)


@requires_emulation
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("options", ["plain", "all"])
@pytest.mark.parametrize("V", [100, 1300])  # fewer columns than the block's 512 threads, and 2-3 per thread
def test_cuda_emulation_rows_match_cpu_kernel(emu, dtype, options, V):
    """Loss, logsumexp and gradient of the CUDA kernel (one block per row, per-thread online softmax, fixed-tree
    combine) against the CPU kernel, with a gradient in a separate buffer and written over the logits, class weights,
    per-row scales, ignored rows, softcap; every buffer between NaN guards."""
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    logits = make((5, V), dtype, low=-6, high=6, seed=1)
    t = targets((5,), V)
    cw = class_weight(V, acc) if options == "all" else None
    kw = (0.1, 1e-2, 4.0) if options == "all" else (0.0, 0.0, 0.0)
    scale = make((5, 2), acc, low=0.5, high=2, seed=2)
    want_grad = torch.empty_like(logits)
    want = torch.ops.fused.cross_entropy_rows(logits, t, cw, scale, want_grad, -100, *kw)
    grad = buf(torch.zeros_like(logits))
    got = emu_rows(emu, buf(logits), t, cw, scale, grad, -100, *kw)
    for a, e in zip(got, want):
        assert_close(a, e, scale=4)
    assert_close(grad, want_grad, scale=4)
    in_place = buf(logits)
    emu_rows(emu, in_place, t, cw, scale, in_place, -100, *kw)
    assert_close(in_place, want_grad, scale=4)
    no_grad = emu_rows(emu, buf(logits), t, cw, scale[0], None, -100, *kw)
    for a, e in zip(no_grad, want):
        assert_close(a, e, scale=4)


@requires_emulation
def test_cuda_emulation_rows_special_cases(emu):
    """Same bits under other block and thread orders and SM counts (fixed-order combine); a confident prediction's
    true-class gradient in bf16 written over its logits (Liger #1329); masked (-inf) logits with smoothing give
    eager's inf; an out-of-range target gives that row NaN (no host sync on a GPU); no rows launch nothing."""
    logits = make((3, 700), low=-5, high=5, seed=3)
    t = torch.tensor([0, 699, 350])
    runs = []
    for seed, sms in [(1, 1), (0, 1), (12345, 3), (99, 132)]:  # (test_cuda_emulation.py's reschedule orders)
        emu.set_schedule_seed(seed)
        emu.set_sm_count(sms)
        grad = buf(torch.zeros_like(logits))
        runs.append(
            (*emu_rows(emu, buf(logits), t, class_weight(700), torch.ones(2), grad, -100, 0.1, 1e-3, 0.0), grad.clone())
        )
    emu.set_schedule_seed(1)
    emu.set_sm_count(1)
    for run in runs[1:]:
        assert all(torch.equal(a, c) for a, c in zip(run, runs[0]))

    confident = torch.randn(2, 500, generator=torch.Generator().manual_seed(0))
    confident[:, 3] = math.log(0.999 / 0.001 * confident.exp().sum(1).mean().item())
    x16 = buf(confident.bfloat16())
    x64 = x16.double().requires_grad_()
    exact = torch.autograd.grad(F.cross_entropy(x64, torch.tensor([3, 3]), reduction="sum"), x64)[0][:, 3]
    emu_rows(emu, x16, torch.tensor([3, 3]), None, torch.ones(2), x16, -100, 0.0, 0.0, 0.0)
    assert rel_error(x16[:, 3], exact) < 1e-2

    masked = make((2, 1300), seed=6)
    masked[0, :600] = float("-inf")
    for ls in (0.0, 0.1):
        loss, _ = emu_rows(emu, buf(masked), torch.tensor([900, 7]), None, torch.ones(2), None, -100, ls, 0.0, 0.0)
        torch.testing.assert_close(
            loss, F.cross_entropy(masked, torch.tensor([900, 7]), reduction="none", label_smoothing=ls)
        )
    grad = buf(torch.zeros(2, 1300))
    loss, lse = emu_rows(emu, buf(masked), torch.tensor([700, 1300]), None, torch.ones(2), grad, -100, 0.0, 0.0, 0.0)
    assert torch.isfinite(loss[0]) and loss[1].isnan() and grad[1].isnan().all() and torch.isfinite(grad[0]).all()
    empty = emu_rows(
        emu, buf(masked[:0]), torch.zeros(0, dtype=torch.long), None, torch.ones(2), None, -100, 0.0, 0.0, 0.0
    )
    assert empty[0].shape == (0,)


def zero_weight_sum_cases():
    """Class weights with label smoothing where a thread's (or a block's) weight sum is 0: weight 0 on a -inf logit
    (eager's loss is NaN: 0 * inf), and weights +1 / -1 that cancel in every thread's stride of 512 columns.
    (logits, target, weight) per case, float32."""
    masked = make((1, 8), seed=4)
    masked[0, 0] = float("-inf")
    w_masked = torch.ones(8)
    w_masked[0] = 0.0
    cancelling = torch.where(torch.arange(1024) < 512, 1.0, -1.0)
    return [(masked, torch.tensor([3]), w_masked), (make((2, 1024), seed=5), torch.tensor([5, 700]), cancelling)]


@requires_emulation
def test_cuda_emulation_smoothing_with_zero_weight_sums(emu):
    """The block's combine keeps a thread's smoothing sum when its weight sum is 0, and folds in the smoothing terms
    of threads that saw only -inf logits: eager's loss, as accurate as eager's against float64."""
    for logits, t, w in zero_weight_sum_cases():
        got, _ = emu_rows(emu, buf(logits), t, w, torch.ones(2), None, -100, 0.1, 0.0, 0.0)
        eager = F.cross_entropy(logits, t, weight=w, reduction="none", label_smoothing=0.1)
        exact = F.cross_entropy(logits.double(), t, weight=w.double(), reduction="none", label_smoothing=0.1)
        assert_accuracy(got, eager, exact)


@requires_emulation
def test_cuda_emulation_no_classes_reads_nothing(emu):
    """V = 0 with targets that are not ignored: those rows get NaN, read from no address (null logits, as an empty
    CUDA tensor has: a read faults)."""
    loss, lse = out((3,), torch.float32), out((3,), torch.float32)
    no_logits = (None, 0, None, 0)  # logits, ld, grad, ldg
    targets_, scale = buf(torch.tensor([0, -100, 5])), buf(torch.ones(2))
    launch(emu.cross_entropy_rows, 0, *no_logits, targets_, None, None, scale, 0, loss, lse, 3, 0, -100, 0.1, 0.0, 0.0)
    for got in (loss, lse):
        assert got[[0, 2]].isnan().all() and got[1] == 0


# ---- a real client: a GPT-2-style model trained with the fused loss on its tied embedding ----
class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"), nn.Linear(4 * d, d))

    def forward(self, x):
        h = self.ln1(x)
        causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device).triu(1)
        x = x + self.attn(h, h, h, attn_mask=causal, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """GPT-2's layout: token + position embeddings, pre-norm blocks, a final LayerNorm, and the LM head tied to
    the token embedding; forward returns the loss of `loss_fn(hidden, lm_head_weight, targets)`."""

    def __init__(self, vocab=96, d=32, heads=2, layers=2, block=16):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(block, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)

    def forward(self, idx, targets, loss_fn):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return loss_fn(self.ln_f(x), self.wte.weight, targets)


def eager_loss(h, w, t):
    return F.cross_entropy(F.linear(h, w).flatten(0, 1), t.flatten())


def fused_loss(h, w, t):
    return fused.linear_cross_entropy(h, w, t)


def gpt_batch(step, rank=0, batch=4, seq=16, vocab=96):
    g = torch.Generator().manual_seed(100 * step + rank)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    targets = tokens[:, 1:].clone()
    targets[:, -3:][torch.rand(batch, 3, generator=g) < 0.5] = -100  # padding at the ends
    return tokens[:, :-1], targets


def train_gpt(loss_fn, dtype, steps=3, seed=0):
    torch.manual_seed(seed)
    model = TinyGPT().to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        loss = model(*gpt_batch(step), loss_fn)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses), torch.cat([p.detach().flatten() for p in model.parameters()])


def test_gpt2_training_matches_eager():
    """Losses and parameters after 3 SGD steps (lr=0.5, momentum 0.9): the fused loss's error against a float64 run
    is no worse than the eager loss's (x2), judged over SEEDS initialisations (assert_accuracy_over_seeds: training
    grows a rounding difference, so one run's error moves with the machine's GEMM)."""
    losses, params = [], []
    for seed in range(SEEDS):
        runs = [
            train_gpt(fn, dtype, seed=seed)
            for fn, dtype in ((fused_loss, torch.float32), (eager_loss, torch.float32), (eager_loss, torch.float64))
        ]
        losses.append(tuple(r[0] for r in runs))
        params.append(tuple(r[1] for r in runs))
        assert (runs[0][0][-1] < runs[0][0][0]).item()
    assert_accuracy_over_seeds(losses)
    assert_accuracy_over_seeds(params)
    exact_losses, exact_params = losses[0][2], params[0][2]
    f64_losses, f64_params = train_gpt(fused_loss, torch.float64)
    assert_close(f64_losses, exact_losses)
    assert_close(f64_params, exact_params, scale=100)


def fsdp_gpt_worker(rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from tests.test_distributed_optim import WORLD, full

    torch.manual_seed(0)
    model = TinyGPT()
    mesh = init_device_mesh("cpu", (WORLD,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    losses = []
    for step in range(3):
        opt.zero_grad()
        loss = model(*gpt_batch(step, rank), fused_loss)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    # one process, both ranks' batches, the mean of their losses (FSDP averages the gradients)
    torch.manual_seed(0)
    single = TinyGPT()
    single_opt = torch.optim.SGD(single.parameters(), lr=0.5, momentum=0.9)
    for step in range(3):
        single_opt.zero_grad()
        per_rank = [single(*gpt_batch(step, r), fused_loss) for r in range(WORLD)]
        sum(per_rank).div(WORLD).backward()
        single_opt.step()
        torch.testing.assert_close(losses[step], per_rank[rank].detach(), rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), single.parameters()):
        torch.testing.assert_close(full(p.detach()), q.detach(), rtol=1e-5, atol=1e-6)


def test_gpt2_training_fsdp2():
    import os
    import tempfile

    import torch.multiprocessing as mp

    from tests.test_distributed_optim import WORLD, run_worker

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(run_worker, args=(fsdp_gpt_worker, os.path.join(tmp, "init")), nprocs=WORLD, join=True)
