"""fused.linear_log_probs and fused.linear_distillation_loss (and their fused.nn modules) against the reference
(fused/loss/reference.py: the formulas on full logits) and against float64: values and every gradient within
eager's error (x2) in fp32 / fp16 / bf16, reduction "none" and per-token upstream gradients of any weights (the
bug class of Liger-Kernel #678 / #968), temperature, ignore_index and all-ignored batches, teacher and student of
different hidden sizes, confident predictions in bf16, the entropy of a uniform row, JSD's beta at 0, 0.5 and 1,
and a GRPO-style clipped surrogate against eager."""

import math

import pytest
import torch

import fused
from fused.loss import chunked
from fused.loss import reference as ref
from fused.loss.distillation import DIVERGENCES
from tests import cuda_emulation
from tests import harness as h
from tests.test_cuda_emulation import buf, launch, out

V = 131


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    """A few rows per chunk, so every test runs the chunked path over several chunks."""
    monkeypatch.setattr(chunked, "CHUNK_BYTES", 2048)


def head(shape, D, dtype=torch.float32, seed=0, bias=True):
    """input [*shape, D], weight [V, D], bias [V] at nn.Linear's scale (logits O(1)), all requiring grad."""
    bound = 1.0 / math.sqrt(D)
    x = h.make((*shape, D), dtype, low=-2, high=2, seed=seed, requires_grad=True)
    w = h.make((V, D), dtype, low=-3 * bound, high=3 * bound, seed=seed + 1, requires_grad=True)
    b = h.make((V,), dtype, low=-1, high=1, seed=seed + 2, requires_grad=True) if bias else None
    return x, w, b


def targets(shape, seed=0, ignore_index=-100):
    t = torch.randint(0, V, shape, generator=torch.Generator().manual_seed(seed))
    t.view(-1)[::4] = ignore_index
    return t


def as64(tensors):
    return [None if t is None else t.detach().double().requires_grad_(t.requires_grad) for t in tensors]


def outputs_and_grads(fn, leaves, upstream):
    """fn's outputs and the gradients of sum(out * weight) over leaves (per-token upstream weights)."""
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    total = sum((o * u.to(o.dtype)).sum() for o, u in zip(outs, upstream))
    return list(outs) + list(torch.autograd.grad(total, [t for t in leaves if t is not None]))


def check_accuracy(fused_fn, ref_fn, leaves, upstream):
    """Each output and gradient: our error against float64 within 2x eager's (the reference in the same dtype)."""
    ours = outputs_and_grads(fused_fn, leaves, upstream)
    eager = outputs_and_grads(ref_fn, leaves, upstream)
    exact = outputs_and_grads(ref_fn, as64(leaves), upstream)
    assert len(ours) == len(exact)
    for o, e, x in zip(ours, eager, exact):
        assert o.dtype == e.dtype and o.shape == x.shape
        h.assert_accuracy(o, e, x)


# ---- linear_log_probs ----
@pytest.mark.parametrize("dtype", h.FLOAT_DTYPES)
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_log_probs_accuracy_with_per_token_gradients(dtype, temperature):
    x, w, b = head((3, 7), 24, dtype)
    t = targets((3, 7))
    upstream = [h.make((3, 7), seed=5, low=-2, high=2), h.make((3, 7), seed=6, low=-2, high=2)]

    def ours(x, w, b):
        return fused.linear_log_probs(x, w, t, linear_bias=b, temperature=temperature, return_entropy=True)

    def eager(x, w, b):
        return ref.linear_log_probs(x, w, t, b, temperature, return_entropy=True)

    check_accuracy(ours, eager, [x, w, b], upstream)
    logp, entropy = ours(x, w, b)
    assert logp.dtype == torch.float32 and (logp[t == -100] == 0).all() and (entropy[t == -100] == 0).all()


def test_log_probs_only_logp_and_float64():
    x, w, b = as64(head((10,), 8))
    t = targets((10,))
    logp = fused.linear_log_probs(x, w, t, linear_bias=b)
    assert logp.dtype == torch.float64
    h.assert_close(logp, ref.linear_log_probs(x, w, t, b))
    g = torch.autograd.grad(logp.sum(), x)[0]
    h.assert_close(g, torch.autograd.grad(ref.linear_log_probs(x, w, t, b).sum(), x)[0])
    assert (g[t == -100] == 0).all()  # ignored tokens: no gradient


def test_log_probs_ignore_index_and_all_ignored():
    x, w, b = head((6,), 8)
    for ignore_index in (-100, 3):
        t = torch.full((6,), ignore_index)
        logp, entropy = fused.linear_log_probs(x, w, t, linear_bias=b, ignore_index=ignore_index, return_entropy=True)
        assert (logp == 0).all() and (entropy == 0).all()
        grads = torch.autograd.grad((logp + entropy).sum(), [x, w, b])
        assert all((g == 0).all() for g in grads)
    t = targets((6,), ignore_index=0)
    t[1] = 3  # ignore_index inside the class range: those tokens only
    got = fused.linear_log_probs(x, w, t, linear_bias=b, ignore_index=3)
    h.assert_close(got, ref.linear_log_probs(x, w, t, b, ignore_index=3))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_entropy_of_uniform_row_is_log_v(dtype):
    x = h.make((4, 8), dtype)
    w = torch.zeros(V, 8, dtype=dtype)
    logp, entropy = fused.linear_log_probs(x, w, torch.arange(4), return_entropy=True)
    assert (entropy - math.log(V)).abs().max() <= 2e-6 and (logp + math.log(V)).abs().max() <= 2e-6


def test_confident_predictions_exact_in_bf16():
    """log p_t near 0 (p_t = 0.9 .. 0.9999): logp and its gradient computed from the bf16 logits in fp32 (the
    target's 1 - p_t from expm1, not from a rounded p_t), as exact as float64 on the same bf16 logits."""
    rows = []
    for i, p_t in enumerate((0.9, 0.99, 0.999, 0.9999)):
        row = torch.randn(V, generator=torch.Generator().manual_seed(i), dtype=torch.float64)
        row[7] = math.log(p_t / (1 - p_t) * row.exp().sum().item())
        rows.append(row)
    logits = torch.stack(rows).bfloat16()
    t = torch.full((4,), 7)
    w = logits.t().contiguous().requires_grad_()  # input = one-hot rows: the logits are w's columns
    logp = fused.linear_log_probs(torch.eye(4, dtype=torch.bfloat16), w, t)
    w64 = logits.double().t().contiguous().requires_grad_()
    logp64 = ref.linear_log_probs(torch.eye(4, dtype=torch.float64), w64, t)
    assert (logp64 > -0.2).all() and h.rel_error(logp, logp64) < 1e-5
    g, g64 = torch.autograd.grad(logp.sum(), w)[0][7], torch.autograd.grad(logp64.sum(), w64)[0][7]
    for i in range(4):  # each 1 - p_t to bf16's rounding of itself, however small
        assert h.rel_error(g[i : i + 1], g64[i : i + 1]) <= torch.finfo(torch.bfloat16).eps


def test_grpo_clipped_surrogate_matches_eager():
    """Log-prob ratios of a policy against a frozen copy, PPO/GRPO clipped surrogate with per-token advantages and
    a mask, mean per sequence then over sequences, backward: equal to the same on eager full logits."""
    x, w, b = head((4, 9), 16)
    t = targets((4, 9))
    w_old = (w.detach() + 0.05 * h.make(w.shape, seed=9)).requires_grad_(False)
    adv = h.make((4, 1), seed=11, low=-1, high=1).expand(4, 9)
    mask = (t != -100).float()

    def surrogate(log_probs, x, w, b):
        logp = log_probs(x, w, t, b)
        with torch.no_grad():
            old = log_probs(x, w_old, t, b)
        ratio = torch.exp(logp - old)
        per_token = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
        return ((per_token * mask).sum(1) / mask.sum(1)).mean()

    def ours(x, w, t, b):
        return fused.linear_log_probs(x, w, t, linear_bias=b)

    got = outputs_and_grads(lambda *a: surrogate(ours, *a), [x, w, b], [torch.ones(())])
    want = outputs_and_grads(lambda *a: surrogate(ref.linear_log_probs, *a), [x, w, b], [torch.ones(())])
    for g, e in zip(got, want):
        h.assert_close(g, e)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_policy_gradient_with_tied_embedding_and_sliced_hidden(dtype):
    """TRL's GRPO / PPO shape of use: the log-probs of a completion from hidden[:, :-1] (a non-contiguous slice of
    the model's [batch, seq, hidden] output), padding as ignore_index, temperature, entropy, a head tied to the input
    embedding (its gradient sums both uses) with a bias; the loss sum(adv * exp(logp - logp.detach()) * mask) plus
    an entropy bonus. Loss and the gradients of embedding and bias within eager's error x2 of float64."""
    ids = torch.randint(0, V, (3, 10), generator=torch.Generator().manual_seed(3))
    target = ids[:, 1:].clone()
    target[0, 5:] = -100
    mask = target != -100
    mix = h.make((16, 16), dtype, seed=4, low=-0.5, high=0.5)
    adv = h.make((3, 1), seed=5, low=-1, high=1)
    emb = h.make((V, 16), dtype, seed=6, low=-1, high=1, requires_grad=True)
    bias = h.make((V,), dtype, seed=7, low=-1, high=1, requires_grad=True)

    def step(log_probs):
        def loss(emb, bias):
            hidden = torch.tanh(emb[ids] @ mix.to(emb.dtype)) * 3  # [batch, seq + 1, hidden]
            logp, entropy = log_probs(hidden[:, :-1], emb, target, bias)
            pg = (adv * torch.exp(logp - logp.detach()) * mask).sum()
            return pg + 0.01 * (entropy * mask).sum()

        return loss

    def ours(x, w, t, b):
        assert not x.is_contiguous()
        return fused.linear_log_probs(x, w, t, linear_bias=b, temperature=0.7, return_entropy=True)

    def eager(x, w, t, b):
        return ref.linear_log_probs(x, w, t, b, temperature=0.7, return_entropy=True)

    check_accuracy(step(ours), step(eager), [emb, bias], [torch.ones(())])


# ---- linear_distillation_loss ----
@pytest.mark.parametrize("dtype", h.FLOAT_DTYPES)
@pytest.mark.parametrize("divergence", ["forward_kl", "reverse_kl", "jsd"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_distillation_accuracy(dtype, divergence, reduction):
    """Teacher and student of different hidden sizes, temperature 2, ignored tokens; "none" with arbitrary
    per-token upstream weights."""
    x, w, b = head((2, 9), 16, dtype)
    xt, wt, bt = (t.detach() for t in head((2, 9), 40, dtype, seed=10))
    tgt = targets((2, 9))
    upstream = [h.make((2, 9), seed=7, low=-2, high=2) if reduction == "none" else torch.ones(())]
    kw = dict(divergence=divergence, beta=0.3, temperature=2.0, reduction=reduction)

    def ours(x, w, b):
        return fused.linear_distillation_loss(x, w, xt, wt, tgt, student_bias=b, teacher_bias=bt, **kw)

    def eager(x, w, b):
        xt_, wt_, bt_ = (t.to(x.dtype) for t in (xt, wt, bt))
        return ref.linear_distillation_loss(x, w, xt_, wt_, tgt, b, bt_, **kw)

    check_accuracy(ours, eager, [x, w, b], upstream)
    if reduction == "none":
        assert (ours(x, w, b)[tgt == -100] == 0).all()


@pytest.mark.parametrize("upcast", [False, True])
def test_distillation_16bit_gemm_paths(monkeypatch, upcast):
    """Both ways the CPU runs 16-bit chunks (chunked.gemm_dtype), whichever this machine takes: bf16 GEMMs (the
    weight gradient added into float32 a slice of classes at a time, the bias gradient a few rows at a time), or
    float32 GEMMs on weights upcast a slice of classes at a time through one buffer that the teacher, 40 wide, shares
    with the student, 16 wide."""
    monkeypatch.setattr(chunked, "gemm_dtype", lambda t: torch.float32 if upcast else t.dtype)
    monkeypatch.setattr(chunked, "SUM_ELEMENTS", 2 * V)  # two rows at a time
    x, w, b = head((2, 9), 16, torch.bfloat16)
    xt, wt, bt = (t.detach() for t in head((2, 9), 40, torch.bfloat16, seed=10))
    tgt = targets((2, 9))
    kw = dict(divergence="jsd", beta=0.3, temperature=2.0, reduction="none")

    def ours(x, w, b):
        return fused.linear_distillation_loss(x, w, xt, wt, tgt, student_bias=b, teacher_bias=bt, **kw)

    def eager(x, w, b):
        xt_, wt_, bt_ = (t.to(x.dtype) for t in (xt, wt, bt))
        return ref.linear_distillation_loss(x, w, xt_, wt_, tgt, b, bt_, **kw)

    check_accuracy(ours, eager, [x, w, b], [h.make((2, 9), seed=7, low=-2, high=2)])


@pytest.mark.parametrize("native_16bit_gemm", [False, True])
@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_distillation_teacher_and_student_in_different_dtypes(monkeypatch, native_16bit_gemm, divergence):
    """A bf16 student with a float32 teacher and the reverse, through both ways the CPU runs 16-bit chunks (bf16
    logits, as on a GPU, or float32). Heads of the identity, so each head's logits are its input exactly: eager
    (the reference on each head's own logits) then errs only by float32's rounding, and a float32 teacher rounded
    to bf16 to meet the student's logits (errors 1e3x that) shows. Loss and gradients within eager's x2."""
    monkeypatch.setattr(chunked, "gemm_dtype", lambda t: t.dtype if native_16bit_gemm else torch.float32)
    for student, teacher in ((torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)):
        x = h.make((2, 9, V), student, seed=1, requires_grad=True)
        w = torch.eye(V, dtype=student, requires_grad=True)
        xt, wt = h.make((2, 9, V), teacher, seed=2), torch.eye(V, dtype=teacher)
        tgt = targets((2, 9))
        kw = dict(divergence=divergence, beta=0.3, temperature=2.0, reduction="none")

        def ours(x, w):
            return fused.linear_distillation_loss(x, w, xt, wt, tgt, **kw)

        def eager(x, w):
            return ref.linear_distillation_loss(x, w, xt, wt, tgt, **kw)

        upstream = [h.make((2, 9), seed=7, low=-2, high=2)]
        check_accuracy(ours, eager, [x, w], upstream)
        mean = dict(kw, reduction="mean")  # gradients computed in forward
        check_accuracy(
            lambda x, w: fused.linear_distillation_loss(x, w, xt, wt, tgt, **mean),
            lambda x, w: ref.linear_distillation_loss(x, w, xt, wt, tgt, **mean),
            [x, w],
            [torch.ones(())],
        )


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_jsd_beta(beta):
    x, w, b = head((12,), 8)
    xt, wt, _ = (t.detach() for t in head((12,), 8, seed=3))
    loss = fused.linear_distillation_loss(x, w, xt, wt, student_bias=b, divergence="jsd", beta=beta)
    grads = torch.autograd.grad(loss, [x, w, b])
    want = ref.linear_distillation_loss(x, w, xt, wt, None, b, divergence="jsd", beta=beta)
    want_grads = torch.autograd.grad(want, [x, w, b])
    h.assert_close(loss, want)
    for g, e in zip(grads, want_grads):
        h.assert_close(g, e)
    if beta in (0.0, 1.0):  # a distribution against itself
        assert loss == 0 and all((g == 0).all() for g in grads)
    else:
        assert loss > 0


def test_distillation_all_ignored_and_no_target():
    x, w, b = head((5,), 8)
    xt, wt, _ = (t.detach() for t in head((5,), 12, seed=3))
    t = torch.full((5,), -100)
    for reduction in ("mean", "sum", "none"):  # "mean" of no token: 0, as TRL's and Liger's (test_logprob_ported.py)
        loss = fused.linear_distillation_loss(x, w, xt, wt, t, reduction=reduction)
        assert (loss == 0).all() and all((g == 0).all() for g in torch.autograd.grad(loss.sum(), [x, w]))
    got = fused.linear_distillation_loss(x, w, xt, wt, reverse := None, divergence="reverse_kl")
    assert reverse is None
    h.assert_close(got, ref.linear_distillation_loss(x, w, xt, wt, None, divergence="reverse_kl"))


def test_teacher_gets_no_gradient_and_second_backward():
    x, w, b = head((6,), 8)
    xt, wt, bt = head((6,), 10, seed=3)
    loss = fused.linear_distillation_loss(x, w, xt, wt, student_bias=b, teacher_bias=bt)
    loss.backward(retain_graph=True)
    assert xt.grad is None and wt.grad is None and bt.grad is None
    first = w.grad.clone()
    w.grad = None
    loss.backward()  # forward's gradients were consumed: the backward op recomputes them
    h.assert_close(w.grad, first)


def test_gradcheck_float64():
    x, w, b = as64(head((3,), 5))
    t = torch.tensor([1, -100, 4])
    xt, wt = h.make((3, 4), torch.float64, seed=4), h.make((V, 4), torch.float64, seed=5)
    torch.autograd.gradcheck(
        lambda x, w, b: fused.linear_log_probs(x, w, t, linear_bias=b, temperature=0.7, return_entropy=True),
        (x, w, b),
    )
    for divergence in ("forward_kl", "reverse_kl", "jsd"):
        torch.autograd.gradcheck(
            lambda x, w, b: fused.linear_distillation_loss(
                x, w, xt, wt, t, student_bias=b, divergence=divergence, temperature=1.5, reduction="none"
            ),
            (x, w, b),
        )


def test_compile_fullgraph():
    x, w, b = head((2, 5), 8)
    xt, wt, _ = (t.detach() for t in head((2, 5), 6, seed=3))
    t = targets((2, 5))
    h.check_compile(lambda x, w, b: fused.linear_log_probs(x, w, t, linear_bias=b, return_entropy=True), x, w, b)
    h.check_compile_grads(
        lambda x, w, b: fused.linear_log_probs(x, w, t, linear_bias=b, return_entropy=True)[1].sum(), x, w, b
    )
    h.check_compile_grads(
        lambda x, w: fused.linear_distillation_loss(x, w, xt, wt, t, divergence="jsd", reduction="none").sum(), x, w
    )
    h.check_compile_grads(lambda x, w: fused.linear_distillation_loss(x, w, xt, wt, t), x, w)


def test_modules_match_functional():
    x, w, b = head((2, 5), 8)
    xt, wt, _ = (t.detach() for t in head((2, 5), 6, seed=3))
    t = targets((2, 5))
    module = fused.nn.FusedLinearLogProbs(temperature=0.8, return_entropy=True)
    for got, want in zip(
        module(x, w, t, b), fused.linear_log_probs(x, w, t, linear_bias=b, temperature=0.8, return_entropy=True)
    ):
        assert torch.equal(got, want)
    module = fused.nn.FusedLinearDistillationLoss(divergence="reverse_kl", temperature=2.0)
    assert torch.equal(
        module(x, w, xt, wt, t),
        fused.linear_distillation_loss(x, w, xt, wt, t, divergence="reverse_kl", temperature=2.0),
    )
    with h.raises("fused.nn.FusedLinearDistillationLoss: divergence must be"):
        fused.nn.FusedLinearDistillationLoss(divergence="kl")


MASKED = 3  # the last columns of the masked-vocabulary tests, through a bias of -inf


def masked_bias(V, value=-math.inf, dtype=torch.float64):
    return torch.where(torch.arange(V) >= V - MASKED, value, 0.0).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_masked_vocabulary_gives_finite_entropy_and_divergences(dev, dtype):
    """Logits of -inf (a vocabulary masked through the bias) have p = 0 and add nothing (0 log 0 = 0, as
    Categorical.entropy and F.kl_div): entropy, KL and JSD and their gradients are finite and as accurate as eager's
    formulas with a bias of -1e4 (whose p is exactly 0), judged against float64 (as Categorical.entropy too)."""
    N, K, V = 6, 8, 40
    x, w = (
        h.make((N, K), dtype, dev, seed=1, requires_grad=True),
        h.make((V, K), dtype, dev, seed=2, requires_grad=True),
    )
    xt, wt = h.make((N, K), dtype, dev, seed=3), h.make((V, K), dtype, dev, seed=4)
    t = torch.randint(0, V - MASKED, (N,), generator=torch.Generator().manual_seed(5)).to(dev)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    bias = {"inf": masked_bias(V).to(dtype), "big": masked_bias(V, -1e4).to(dtype), "big64": masked_bias(V, -1e4)}
    bias = {k: v.to(dev) for k, v in bias.items()}
    floor = 4 * torch.finfo(dtype).eps if dtype == torch.float32 else 1e-14  # harness's default for the dtype

    def check(ours, eager, exact, what):
        """Each output and the gradients of their sum for x and w: finite, within eager's error x2 of float64."""
        grads = [torch.autograd.grad(sum(o.sum() for o in outs), inputs) for outs, inputs in
                 ((ours, (x, w)), (eager, (x, w)), (exact, (x64, w64)))]  # fmt: skip
        names = [f"{what} output {i}" for i in range(len(ours))] + [f"{what} grad x", f"{what} grad w"]
        for name, o, e, r in zip(names, (*ours, *grads[0]), (*eager, *grads[1]), (*exact, *grads[2])):
            assert o.isfinite().all(), name
            h.assert_accuracy(o.double(), e.double(), r, floor=floor, what=name)

    ours = fused.linear_log_probs(x, w, t, linear_bias=bias["inf"], return_entropy=True)
    eager = ref.linear_log_probs(x, w, t, linear_bias=bias["big"], return_entropy=True)
    check(ours, eager, ref.linear_log_probs(x64, w64, t, linear_bias=bias["big64"], return_entropy=True), "log_probs")
    entropy = torch.distributions.Categorical(logits=x64.detach() @ w64.detach().T + bias["inf"].double()).entropy()
    h.assert_accuracy(ours[1].double(), eager[1].double(), entropy, floor=floor)
    for divergence, student_masked in (("forward_kl", False), ("jsd", False), ("reverse_kl", True), ("jsd", True)):
        kw = dict(divergence=divergence, reduction="none")

        def run(fn, s_in, s_w, teacher_bias, student_bias):
            cast = (lambda v: v) if s_in.dtype == dtype else (lambda v: v.double())
            return (fn(s_in, s_w, cast(xt), cast(wt), t, student_bias=student_bias, teacher_bias=teacher_bias, **kw),)

        masked = {k: (v if student_masked else None) for k, v in bias.items()}
        check(
            run(fused.linear_distillation_loss, x, w, bias["inf"], masked["inf"]),
            run(ref.linear_distillation_loss, x, w, bias["big"], masked["big"]),
            run(ref.linear_distillation_loss, x64, w64, bias["big64"], masked["big64"]),
            f"{divergence} (student masked: {student_masked})",
        )


@pytest.mark.parametrize("divergence", ["forward_kl", "reverse_kl", "jsd"])
def test_distillation_logits_far_from_zero(dev, divergence):
    """Logits with a large common offset (a bias of 1000 and 500, as log_softmax's inputs often carry): log p is
    formed as (z - m) - log_s, so the offset's ulp (6e-5 at 1000) never enters p; forming z - (m + log_s) would
    put it into every p of the row. Loss and student gradients within eager's error x2 of float64."""
    N, K, V = 8, 16, 300
    x = h.make((N, K), torch.float32, dev, low=-1, high=1, seed=1, requires_grad=True)
    w = h.make((V, K), torch.float32, dev, low=-1, high=1, seed=2, requires_grad=True)
    xt, wt = h.make((N, K), torch.float32, dev, low=-1, high=1, seed=3), h.make((V, K), torch.float32, dev, seed=4)
    t = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(5)).to(dev)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    b_s, b_t = torch.full((V,), 1000.0, device=dev), torch.full((V,), 500.0, device=dev)

    def run(fn, s_in, s_w):
        cast = (lambda v: v) if s_in.dtype == torch.float32 else (lambda v: v.double())
        loss = fn(s_in, s_w, cast(xt), cast(wt), t, student_bias=cast(b_s), teacher_bias=cast(b_t),
                  divergence=divergence, reduction="none")  # fmt: skip
        return (loss, *torch.autograd.grad(loss.sum(), (s_in, s_w)))

    ours, eager = run(fused.linear_distillation_loss, x, w), run(ref.linear_distillation_loss, x, w)
    exact = run(ref.linear_distillation_loss, x64, w64)
    for name, o, e, r in zip(("loss", "grad x", "grad w"), ours, eager, exact):
        h.assert_accuracy(o.double(), e.double(), r, what=name)


def test_errors_name_op_and_argument():
    x, w, b = head((4,), 8)
    xt, wt, _ = head((4,), 6, seed=3)
    t = torch.tensor([0, 1, 2, 3])
    lp, kd = "fused.linear_log_probs", "fused.linear_distillation_loss"
    with h.raises(f"{lp}: temperature must be > 0"):
        fused.linear_log_probs(x, w, t, temperature=0.0)
    with h.raises(f"{lp}: linear_weight has in_features"):
        fused.linear_log_probs(x, w[:, :5], t)
    with h.raises(f"{lp}: target must hold"):
        fused.linear_log_probs(x, w, t.float())
    with pytest.raises(IndexError, match=f"{lp}: target {V} is out of bounds"):
        fused.linear_log_probs(x, w, torch.tensor([0, V, 1, 2]))
    with h.raises(f"{kd}: divergence must be"):
        fused.linear_distillation_loss(x, w, xt, wt, divergence="kl")
    with h.raises(f"{kd}: beta must be in"):
        fused.linear_distillation_loss(x, w, xt, wt, beta=1.5)
    with h.raises(f"{kd}: reduction must be"):
        fused.linear_distillation_loss(x, w, xt, wt, reduction="avg")
    with h.raises(f"{kd}: teacher_weight must have the vocabulary"):
        fused.linear_distillation_loss(x, w, xt, wt[:7])
    with h.raises(f"{kd}: teacher_input must have the tokens"):
        fused.linear_distillation_loss(x, w, xt[:3], wt)
    with h.raises(f"{kd}: student_bias must be 1-D"):
        fused.linear_distillation_loss(x, w, xt, wt, student_bias=b[:5])
    with h.raises(f"{kd}: teacher_weight has dtype"):
        fused.linear_distillation_loss(x, w, xt, wt.double())
    for device in ("cpu", "meta"):  # the C++ kernel and the fake kernel
        logits = torch.zeros(4, V, device=device)
        with h.raises("fused.log_prob_rows: scale must be"):
            torch.ops.fused.log_prob_rows(logits, t.to(device), torch.zeros(4, device=device), logits, -100, 1.0)
        with h.raises("fused.distillation_rows: teacher_logits must have the shape"):
            torch.ops.fused.distillation_rows(
                logits, logits[:2], None, torch.ones((), device=device), logits, "jsd", 0.5, 1.0, -100
            )
        with h.raises("fused.distillation_rows: divergence must be"):
            torch.ops.fused.distillation_rows(
                logits, logits, None, torch.ones((), device=device), logits, "kl", 0.5, 1.0, -100
            )


# ---- the Triton row kernels under the interpreter, against the CPU kernels ----
@h.requires_triton
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("dtype", h.ALL_DTYPES)
def test_triton_rows_match_cpu_kernels(dtype):
    """The launchers on h.TRITON_DEVICE (the GPU, else CPU tensors under the interpreter) against the CPU ops."""
    from fused.loss import triton_logprob as tk

    acc = torch.float64 if dtype == torch.float64 else torch.float32
    logits, teacher = h.make((6, 300), dtype, low=-6, high=6, seed=1), h.make((6, 300), dtype, low=-6, high=6, seed=2)
    t = torch.tensor([0, -100, 299, 17, 150, 3])
    scale = h.make((6, 2), acc, low=-2, high=2, seed=3)

    def on(*tensors):
        return [x.to(h.TRITON_DEVICE) if isinstance(x, torch.Tensor) else x for x in tensors]

    for temperature in (1.0, 0.7):
        want_grad, got_grad = torch.empty_like(logits), torch.empty_like(logits, device=h.TRITON_DEVICE)
        want = torch.ops.fused.log_prob_rows(logits, t, scale, want_grad, -100, temperature)
        got = tk.log_prob_rows(*on(logits, t, scale), got_grad, -100, temperature)
        for a, e in zip((*got, got_grad), (*want, want_grad)):
            h.assert_close(a.cpu(), e, scale=4)
    for divergence in ("forward_kl", "reverse_kl", "jsd"):
        for beta, target, row_scale in ((0.3, t, scale[:, 0]), (1.0, None, scale[0, 0])):
            args = (target, row_scale)
            want_grad, got_grad = torch.empty_like(logits), torch.empty_like(logits, device=h.TRITON_DEVICE)
            want = torch.ops.fused.distillation_rows(logits, teacher, *args, want_grad, divergence, beta, 1.5, -100)
            got = tk.distillation_rows(*on(logits, teacher, *args), got_grad, divergence, beta, 1.5, -100)
            h.assert_close(got.cpu(), want, scale=4)
            h.assert_close(got_grad.cpu(), want_grad, scale=4)
    masked = logits.clone()
    masked[:, -MASKED:] = -math.inf  # a masked vocabulary: p = 0, nothing added (the CPU kernel is checked above)
    want_grad, got_grad = torch.empty_like(masked), torch.empty_like(masked, device=h.TRITON_DEVICE)
    want = torch.ops.fused.log_prob_rows(masked, t.clamp(max=296), scale, want_grad, -100, 1.0)
    got = tk.log_prob_rows(*on(masked, t.clamp(max=296), scale), got_grad, -100, 1.0)
    for a, e in zip((*got, got_grad), (*want, want_grad)):
        assert a[e.isfinite()].isfinite().all() and e[t != -100].isfinite().all()
        h.assert_close(a.cpu(), e, scale=4)
    for divergence in ("forward_kl", "reverse_kl", "jsd"):
        want = torch.ops.fused.distillation_rows(
            masked, masked.flip(0), t, scale[:, 0], want_grad, divergence, 0.3, 1.0, -100
        )
        got = tk.distillation_rows(*on(masked, masked.flip(0), t, scale[:, 0]), got_grad, divergence, 0.3, 1.0, -100)
        assert want.isfinite().all() and want_grad.isfinite().all()
        h.assert_close(got.cpu(), want, scale=4)
        h.assert_close(got_grad.cpu(), want_grad, scale=4)
    in_place = logits.to(h.TRITON_DEVICE, copy=True)  # the gradient written over the logits, as the chunked driver does
    tk.distillation_rows(in_place, *on(teacher, t, scale[:, 0]), in_place, "reverse_kl", 0.5, 1.0, -100)
    torch.ops.fused.distillation_rows(logits, teacher, t, scale[:, 0], want_grad, "reverse_kl", 0.5, 1.0, -100)
    h.assert_close(in_place.cpu(), want_grad, scale=4)


@h.requires_triton
def test_triton_rows_far_from_zero():
    """The Triton row kernels on logits with a large common offset (1000 and 500): log p = (z - m) - log_s keeps
    the offset's ulp out of p, so loss, log-probs and gradients are as accurate against float64 as the CPU kernels'."""
    from fused.loss import triton_logprob as tk

    logits = h.make((6, 300), low=-6, high=6, seed=1) + 1000.0
    teacher = h.make((6, 300), low=-6, high=6, seed=2) + 500.0
    t, scale = torch.tensor([0, 5, 299, 17, 150, 3]), h.make((6, 2), low=-2, high=2, seed=3)

    def outputs(fn, x, *args):
        """fn's outputs on rows x and the gradient it writes (args: None in the gradient's place)."""
        grad = torch.empty_like(x)
        out = fn(x, *(grad if a is None else a for a in args))
        return (*(out if isinstance(out, tuple) else (out,)), grad)

    def cast(args, to):
        return [to(a) if isinstance(a, torch.Tensor) else a for a in args]

    cases = [("log_prob_rows", [logits, t, scale, None, -100, 1.0])]
    cases += [("distillation_rows", [logits, teacher, t, scale[:, 0], None, d, 0.3, 1.0, -100]) for d in DIVERGENCES]
    for op, args in cases:
        got = outputs(getattr(tk, op), *cast(args, lambda a: a.to(h.TRITON_DEVICE)))
        cpu = outputs(getattr(torch.ops.fused, op), *args)
        exact = outputs(getattr(torch.ops.fused, op), *cast(args, lambda a: a.double() if a.is_floating_point() else a))
        for i, (a, e, r) in enumerate(zip(got, cpu, exact)):
            h.assert_accuracy(a.cpu(), e, r, what=f"{op} {args[5:]} output {i}")


@h.requires_triton
def test_triton_kernels_compile_for_sm90():
    """Both row kernels build for sm_90 through their launchers (tests/triton_sm90.py: a stand-in sm_90 driver,
    compile only) in float32, bfloat16 and float64, with and without gradient and target; their temperature
    divisions correctly rounded (div.rn), none approximate."""
    import re

    stdout = h.compile_for_sm90(["logprob"])
    for kernel, variants in (("_log_prob_rows_kernel", 3), ("_distillation_rows_kernel", 6)):
        stats = re.search(rf"compiled {kernel}: (\d+) variants, .* div.rn.f32 (\d+), div.full.f32 (\d+)", stdout)
        assert stats and int(stats[1]) == variants and int(stats[2]) > 0 and int(stats[3]) == 0, stdout


# ---- the CUDA C++ row kernels, run on the CPU by the host emulation of CUDA (tests/cuda_emulation.py) ----
requires_emulation = pytest.mark.skipif(
    cuda_emulation.unavailable() is not None, reason=str(cuda_emulation.unavailable())
)


def _math(t):
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def emu_log_prob_rows(emu, logits, target, scale, grad, ignore_index, temperature):
    """fused::log_prob_rows' CUDA launcher as the binding calls it, with the op's arguments: logits and grad (None:
    no gradient; it may be logits) guarded buffers (tests/test_cuda_emulation.py's buf): (logp, entropy)."""
    rows, V = logits.shape
    logp, entropy = out((rows,), _math(logits)), out((rows,), _math(logits))
    launch(
        emu.log_prob_rows,
        cuda_emulation.code(logits.dtype),
        logits,
        V,
        grad,
        V if grad is not None else 0,
        buf(target),
        buf(scale),
        logp,
        entropy,
        rows,
        V,
        ignore_index,
        temperature,
    )
    return logp, entropy


def emu_distillation_rows(emu, logits, teacher, target, scale, grad, divergence, beta, temperature, ignore_index):
    """fused::distillation_rows' CUDA launcher, as emu_log_prob_rows: the loss per row."""
    rows, V = logits.shape
    loss = out((rows,), _math(logits))
    launch(
        emu.distillation_rows,
        cuda_emulation.code(logits.dtype),
        logits,
        V,
        buf(teacher),
        V,
        grad,
        V if grad is not None else 0,
        None if target is None else buf(target),
        buf(scale),
        1 if scale.dim() == 1 else 0,
        loss,
        rows,
        V,
        ignore_index,
        ("forward_kl", "reverse_kl", "jsd").index(divergence),
        beta,
        temperature,
    )
    return loss


def identity_head(logits):
    """(input, weight) whose linear layer gives logits exactly: the reference's formulas on given logits."""
    return logits, torch.eye(logits.shape[-1], dtype=logits.dtype)


def log_prob_rows64(logits, target, scale, ignore_index, temperature):
    """fused::log_prob_rows in float64 from the reference: (logp, entropy, gradient of the scaled sum)."""
    z = logits.double().requires_grad_()
    logp, entropy = ref.linear_log_probs(
        *identity_head(z), target, temperature=temperature, ignore_index=ignore_index, return_entropy=True
    )
    s = scale.double()
    return logp, entropy, torch.autograd.grad((s[:, 0] * logp + s[:, 1] * entropy).sum(), z)[0]


def distillation_rows64(logits, teacher, target, scale, divergence, beta, temperature, ignore_index):
    """fused::distillation_rows in float64 from the reference: (loss per row, gradient of the scaled sum)."""
    z = logits.double().requires_grad_()
    kw = dict(divergence=divergence, beta=beta, temperature=temperature, ignore_index=ignore_index)
    loss = ref.linear_distillation_loss(
        *identity_head(z), *identity_head(teacher.double()), target, **kw, reduction="none"
    )
    return loss, torch.autograd.grad((scale.double() * loss).sum(), z)[0]


def check_emulated(got, cpu, ref64):
    """The emulated CUDA kernel's outputs against the CPU kernel's (parity) and against float64: no further off
    than the CPU kernel (x2)."""
    for g, c, r in zip(got, cpu, ref64):
        h.assert_close(g, c, scale=4)
        h.assert_accuracy(g, c, r)


@requires_emulation
@pytest.mark.parametrize("dtype", h.ALL_DTYPES)
@pytest.mark.parametrize("V, temperature", [(1, 1.0), (131, 0.7), (1300, 1.0)])  # 1300: 2-3 columns per thread
def test_cuda_emulation_log_prob_rows(emu, dtype, V, temperature):
    """The CUDA log-prob row kernel (one block per row, per-thread online max / sums, fixed-tree combine): log-probs,
    entropy and gradient against the CPU kernel and float64, with ignored rows, per-row upstream gradients, the
    gradient in its own buffer, over the logits, and none; every buffer between NaN guards."""
    acc = _math(torch.empty(0, dtype=dtype))
    logits = h.make((5, V), dtype, low=-6, high=6, seed=1)
    t = torch.tensor([0, V - 1, -100, V // 2, -100])
    scale = h.make((5, 2), acc, low=-2, high=2, seed=2)
    want_grad = torch.empty_like(logits)
    want = torch.ops.fused.log_prob_rows(logits, t, scale, want_grad, -100, temperature)
    logp64, entropy64, grad64 = log_prob_rows64(logits, t, scale, -100, temperature)
    grad = buf(torch.zeros_like(logits))
    got = emu_log_prob_rows(emu, buf(logits), t, scale, grad, -100, temperature)
    check_emulated((*got, grad), (*want, want_grad), (logp64, entropy64, grad64))
    in_place = buf(logits)
    emu_log_prob_rows(emu, in_place, t, scale, in_place, -100, temperature)
    h.assert_close(in_place.cpu(), want_grad, scale=4)
    for a, e in zip(emu_log_prob_rows(emu, buf(logits), t, scale, None, -100, temperature), want):
        h.assert_close(a, e, scale=4)


DIVERGENCE_CASES = [("forward_kl", 0.5), ("reverse_kl", 0.5), ("jsd", 0.0), ("jsd", 0.3), ("jsd", 1.0)]


@requires_emulation
@pytest.mark.parametrize("dtype", h.ALL_DTYPES)
@pytest.mark.parametrize("divergence, beta", DIVERGENCE_CASES)
def test_cuda_emulation_distillation_rows(emu, dtype, divergence, beta):
    """The CUDA distillation row kernel: the divergence per row and the student's gradient against the CPU kernel
    and float64, for every divergence and JSD's beta at 0, 1 (0 and no gradient) and between, at a temperature, with
    ignored rows and per-row scales; the gradient in its own buffer and over the logits."""
    acc = _math(torch.empty(0, dtype=dtype))
    logits, teacher = h.make((5, 131), dtype, low=-6, high=6, seed=1), h.make((5, 131), dtype, low=-6, high=6, seed=2)
    t = torch.tensor([3, -100, 7, 0, -100])
    scale = h.make((5,), acc, low=0.5, high=2, seed=3)
    args = (t, scale)
    options = (divergence, beta, 0.7, -100)
    want_grad = torch.empty_like(logits)
    want = torch.ops.fused.distillation_rows(logits, teacher, *args, want_grad, *options)
    ref64 = distillation_rows64(logits, teacher, *args, *options)
    grad = buf(torch.zeros_like(logits))
    got = emu_distillation_rows(emu, buf(logits), teacher, *args, grad, *options)
    check_emulated((got, grad), (want, want_grad), ref64)
    in_place = buf(logits)
    emu_distillation_rows(emu, in_place, teacher, *args, in_place, *options)
    h.assert_close(in_place.cpu(), want_grad, scale=4)


@requires_emulation
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cuda_emulation_masked_vocabulary(emu, dtype):
    """-inf logits (a masked vocabulary, some first in a thread's columns) add nothing in the CUDA row kernels: the
    CPU kernels' finite entropy, divergences and gradients."""
    acc = _math(torch.empty(0, dtype=dtype))
    logits = h.make((4, 1300), dtype, low=-6, high=6, seed=6)
    logits[:, :MASKED] = -math.inf
    logits[:, -MASKED:] = -math.inf
    t = torch.tensor([10, -100, 700, 1000])
    scale = h.make((4, 2), acc, low=-2, high=2, seed=7)
    want_grad, grad = torch.empty_like(logits), buf(torch.zeros_like(logits))
    want = torch.ops.fused.log_prob_rows(logits, t, scale, want_grad, -100, 1.0)
    got = emu_log_prob_rows(emu, buf(logits), t, scale, grad, -100, 1.0)
    for a, e in zip((*got, grad), (*want, want_grad)):
        assert e[t != -100].isfinite().all()
        h.assert_close(a, e, scale=4)
    for divergence, beta in DIVERGENCE_CASES:
        options = (divergence, beta, 1.0, -100)
        want = torch.ops.fused.distillation_rows(logits, logits.flip(0), t, scale[:, 0], want_grad, *options)
        got = emu_distillation_rows(emu, buf(logits), logits.flip(0), t, scale[:, 0], grad, *options)
        assert want.isfinite().all() and want_grad.isfinite().all()
        h.assert_close(got, want, scale=4)
        h.assert_close(grad, want_grad, scale=4)


@requires_emulation
@pytest.mark.parametrize("V", [1, 1300])
def test_cuda_emulation_distillation_rows_shapes(emu, V):
    """One class (every divergence 0, no gradient) and rows of 2-3 columns per thread; no target (every row counts),
    one scale for all rows, and no gradient."""
    logits, teacher = h.make((3, V), low=-6, high=6, seed=4), h.make((3, V), low=-6, high=6, seed=5)
    scale = torch.tensor(0.5)
    for divergence, beta in DIVERGENCE_CASES:
        options = (divergence, beta, 1.0, -100)
        want_grad = torch.empty_like(logits)
        want = torch.ops.fused.distillation_rows(logits, teacher, None, scale, want_grad, *options)
        loss64, grad64 = distillation_rows64(logits, teacher, None, scale, *options)
        grad = buf(torch.zeros_like(logits))
        got = emu_distillation_rows(emu, buf(logits), teacher, None, scale, grad, *options)
        check_emulated((got, grad), (want, want_grad), (loss64, grad64))
        h.assert_close(emu_distillation_rows(emu, buf(logits), teacher, None, scale, None, *options), want, scale=4)
