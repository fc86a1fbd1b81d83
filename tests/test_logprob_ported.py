"""fused.linear_log_probs and fused.linear_distillation_loss against the functions they replace, each written here in
plain torch as its project defines it and run in float64 (the exact answer) and in the input's dtype (eager: our
error against float64 must be no worse than its x2). Cases ported from:

- TRL, trl/trainer/utils.py: selective_log_softmax, entropy_from_logits, and their tests (tests/test_utils.py,
  TestSelectiveLogSoftmax, TestEntropyFromLogits); how GRPO (logits / temperature, a completion mask) and DPO
  (log-probs summed over the loss mask) use them.
- TRL, trl/experimental/gkd/gkd_trainer.py: GKDTrainer.generalized_jsd_loss, and its tests
  (tests/experimental/test_gkd_trainer.py, TestGeneralizedJSDLoss).
- Liger-Kernel: test/chunked_loss/test_jsd_loss.py (LigerFusedLinearJSDLoss over the distillation base,
  LigerFusedLinearDistillationBase), test/transformers/test_fused_linear_jsd.py (LigerFusedLinearJSD) and
  test/transformers/test_jsd.py (its torch JSD).

Conventions (DESIGN.md's "Additions (2026-11-25)" fixes the formulas and reductions; fused.linear_distillation_loss's
docstring the rest), and how the other libraries' results convert to ours:
- "jsd" is beta KL(p_T || m) + (1 - beta) KL(p_S || m), m = beta p_T + (1 - beta) p_S: the weighting of TRL's
  generalized_jsd_loss and of Liger's JSD losses (Liger's lerp(q, p, beta) is this m). At beta = 0 and 1 that formula
  is 0; TRL and Liger instead switch there to KL(p_T || p_S) and KL(p_S || p_T), which here are divergence
  "forward_kl" and "reverse_kl".
- Reductions: ours "mean" averages the per-token divergences (summed over the vocabulary) over the counted tokens.
  TRL's "batchmean" with labels is that; without labels it divides the sum by the batch size (dim 0): our "sum" / B.
  TRL's "mean" averages over tokens and vocabulary: our "mean" / V. TRL's "none" is per vocabulary entry: its sum over
  the vocabulary is our "none" (TRL keeps only the unmasked tokens' rows). Liger's losses are our "mean" (and with
  weight_hard_loss, plus that weight times the cross-entropy of the untempered logits).
- No counted token (every target ignore_index): TRL and Liger give a loss of 0 (their counts clamped to 1), and so
  does our "mean".
- Log-probs: ours are 0 (with no gradient) where the target is ignore_index; TRL's functions compute every position,
  and their users multiply by the mask: ours equal TRL's times the mask.
"""

import math

import pytest
import torch
import torch.nn.functional as F

import fused
from fused.loss import chunked
from tests import harness as h
from tests.test_logprob import V, as64, head, outputs_and_grads

IGNORE = -100


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    """A few rows per chunk, so that every case runs the chunked path over several chunks."""
    monkeypatch.setattr(chunked, "CHUNK_BYTES", 2048)


# ---- the other libraries' definitions, in plain torch ----
def trl_selective_log_softmax(logits, index):
    """TRL's selective_log_softmax, as its docstring defines it (the naive log_softmax -> gather)."""
    return torch.gather(logits.log_softmax(-1), dim=-1, index=index.unsqueeze(-1)).squeeze(-1)


def trl_entropy_from_logits(logits):
    logps = F.log_softmax(logits, dim=-1)
    return -(torch.exp(logps) * logps).sum(-1)


def trl_generalized_jsd_loss(
    student_logits,
    teacher_logits,
    labels=None,
    beta=0.5,
    temperature=1.0,
    reduction="batchmean",
    num_items_in_batch=None,
):
    """GKDTrainer.generalized_jsd_loss."""
    student_log_probs = F.log_softmax(student_logits / temperature, dim=-1)
    teacher_log_probs = F.log_softmax(teacher_logits / temperature, dim=-1)
    if beta == 0:
        jsd = F.kl_div(student_log_probs, teacher_log_probs, reduction="none", log_target=True)
    elif beta == 1:
        jsd = F.kl_div(teacher_log_probs, student_log_probs, reduction="none", log_target=True)
    else:
        beta = torch.tensor(beta, dtype=student_log_probs.dtype)
        mixture_log_probs = torch.logsumexp(
            torch.stack([student_log_probs + torch.log1p(-beta), teacher_log_probs + torch.log(beta)]), dim=0
        )
        kl_teacher = F.kl_div(mixture_log_probs, teacher_log_probs, reduction="none", log_target=True)
        kl_student = F.kl_div(mixture_log_probs, student_log_probs, reduction="none", log_target=True)
        jsd = beta * kl_teacher + (1 - beta) * kl_student
    if labels is not None:
        mask = labels != IGNORE
        jsd = jsd[mask]
    if num_items_in_batch is not None:  # the global count of tokens under gradient accumulation
        return jsd.sum() / num_items_in_batch
    if reduction == "batchmean":
        denom = mask.sum().clamp_min(1) if labels is not None else max(jsd.size(0), 1)
        return jsd.sum() / denom
    if reduction == "sum":
        return jsd.sum()
    if reduction == "mean":
        return jsd.mean()
    return jsd


def liger_jsd(log_q, log_p, label=None, beta=0.5, ignore_index=IGNORE):
    """The torch JSD of Liger's test/transformers/test_jsd.py: log_q the student's log-probs, log_p the teacher's."""
    kl = torch.nn.KLDivLoss(reduction="none", log_target=True)
    if beta == 0.0:
        loss = kl(log_q, log_p).sum(dim=-1)
    elif beta == 1.0:
        loss = kl(log_p, log_q).sum(dim=-1)
    else:
        m = torch.lerp(torch.exp(log_q), torch.exp(log_p), beta)
        loss = beta * kl(torch.log(m), log_p).sum(dim=-1) + (1 - beta) * kl(torch.log(m), log_q).sum(dim=-1)
    if label is None:
        return (loss / log_q.shape[0]).sum()
    loss = torch.where(label != ignore_index, loss, 0.0)
    n_non_ignore = (label != ignore_index).sum().item()
    return loss.sum() * 0 if n_non_ignore == 0 else (loss / n_non_ignore).sum()


def upcast(t):
    """Liger's `.float()` of the logits, which keeps float64 for the exact run."""
    return t if t.dtype == torch.float64 else t.float()


def liger_fused_linear_jsd(x, w, xt, wt, label=None, beta=0.5, ignore_index=IGNORE, temperature=1.0):
    """test_fused_linear_jsd.py's TorchLMHeadJSD (LigerFusedLinearJSD's ground truth), with bias-free heads."""
    student = torch.log_softmax(upcast(F.linear(x, w)) / temperature, dim=-1)
    teacher = torch.log_softmax(upcast(F.linear(xt, wt)) / temperature, dim=-1)
    return liger_jsd(student, teacher, label, beta, ignore_index)


def liger_chunked_jsd_loss(x, w, b, xt, wt, bt, target, beta, temperature, ignore_index, weight_hard, weight_soft):
    """LigerFusedLinearJSDLoss as test_jsd_loss.py's HFJSDLoss computes it: the cross-entropy of the student's
    untempered logits ("mean" over the counted tokens) and the JSD of the tempered ones, per counted token."""
    student = upcast(F.linear(x, w, b))
    with torch.no_grad():
        teacher = upcast(F.linear(xt, wt, bt))
    if (target == ignore_index).all():
        return student.sum() * 0
    hard = F.cross_entropy(student, target, ignore_index=ignore_index)
    ls, lt = F.log_softmax(student / temperature, dim=-1), F.log_softmax(teacher / temperature, dim=-1)
    if beta == 0:
        soft = F.kl_div(ls, lt, reduction="none", log_target=True)
    elif beta == 1:
        soft = F.kl_div(lt, ls, reduction="none", log_target=True)
    else:
        lm = torch.logsumexp(torch.stack([ls + math.log(1 - beta), lt + math.log(beta)]), dim=0)
        soft = beta * F.kl_div(lm, lt, reduction="none", log_target=True)
        soft = soft + (1 - beta) * F.kl_div(lm, ls, reduction="none", log_target=True)
    mask = target != ignore_index
    soft = (soft.sum(-1) * mask).sum() / mask.sum().clamp_min(1)
    return weight_hard * hard + weight_soft * soft


def divergence_for(beta):
    """Ours for TRL's and Liger's beta: their beta = 0 and 1 are the KLs, anything between is "jsd"."""
    return {0.0: "forward_kl", 1.0: "reverse_kl"}.get(beta, "jsd")


# ---- the comparison ----
def check_against(ours, theirs, leaves, upstream, slack=2.0):
    """ours(*leaves) against theirs(*leaves): every output and every leaf's gradient of sum(output * upstream)
    within `slack` x the error of theirs run in the leaves' dtype, judged against theirs in float64."""
    got = outputs_and_grads(ours, leaves, upstream)
    eager = outputs_and_grads(theirs, leaves, upstream)
    exact = outputs_and_grads(theirs, as64(leaves), upstream)
    assert len(got) == len(exact)
    for i, (o, e, x) in enumerate(zip(got, eager, exact)):
        assert o.shape == x.shape, f"output {i}: shape {tuple(o.shape)}, want {tuple(x.shape)}"
        h.assert_accuracy(o, e, x, slack=slack, what=f"output {i}")


def completion(B, T, seed=0):
    """Token ids [B, T] and a completion mask (a prompt of 2 and padding at the end of the first sequence)."""
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[:, :2] = False
    mask[0, -3:] = False
    return ids, mask


# ---- TRL: selective_log_softmax, entropy_from_logits, and their use in GRPO and DPO ----
@pytest.mark.parametrize("dtype", h.ALL_DTYPES)
def test_trl_selective_log_softmax_and_entropy_from_logits(monkeypatch, dtype):
    """tests/test_utils.py: TestSelectiveLogSoftmax (an index [...] and [..., K], K = 1 and 8) and
    TestEntropyFromLogits (logits (768,), (32, 768), (8, 16, 768), (2, 4, 8, 768)), on given logits: ours through
    an identity head, an index [..., K] as K calls stacked. Values and the logits' gradients against TRL's in float64,
    within 2x TRL's own error in the logits' dtype."""
    monkeypatch.setattr(chunked, "CHUNK_BYTES", 2**16)  # still several chunks from 32 rows on
    eye = torch.eye(768, dtype=dtype)
    for i, (shape, k) in enumerate((((768,), None), ((32, 768), 1), ((8, 16, 768), 8), ((2, 4, 8, 768), None))):
        logits = h.make(shape, dtype, seed=i, requires_grad=True)
        index = torch.randint(0, 768, (*shape[:-1], k or 1), generator=torch.Generator().manual_seed(i))
        index = index if k else index[..., 0]
        upstream = [h.make(index.shape, seed=10 + i, low=-2, high=2), h.make(shape[:-1], seed=20 + i)]

        def ours(z):
            columns = index.unbind(-1) if k else [index]
            logps = [fused.linear_log_probs(z, eye.to(z.dtype), c, return_entropy=True) for c in columns]
            logp = torch.stack([lp for lp, _ in logps], -1) if k else logps[0][0]
            return logp, logps[0][1]

        def trl(z):
            gathered = torch.gather(z.log_softmax(-1), -1, index) if k else trl_selective_log_softmax(z, index)
            return gathered, trl_entropy_from_logits(z)

        check_against(ours, trl, [logits], upstream)


@pytest.mark.parametrize("dtype", h.FLOAT_DTYPES)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_trl_grpo_per_token_logps_and_entropy(dtype, temperature):
    """GRPO's _get_per_token_logps_and_entropies: logits[:, :-1] / temperature (hidden[:, :-1]: a non-contiguous
    [B, T, H] slice), selective_log_softmax of the completion ids, entropy_from_logits; the loss weighs each by the
    completion mask. Ours with the masked ids as ignore_index, against TRL's times the mask; per-token upstream
    gradients into input, weight and bias."""
    hidden, w, b = head((2, 7), 16, dtype, seed=1)
    ids, mask = completion(2, 6)
    target = torch.where(mask, ids, IGNORE)
    upstream = [h.make((2, 6), seed=5, low=-2, high=2), h.make((2, 6), seed=6, low=-2, high=2)]

    def ours(hidden, w, b):
        x = hidden[:, :-1]
        assert not x.is_contiguous()
        return fused.linear_log_probs(x, w, target, linear_bias=b, temperature=temperature, return_entropy=True)

    def trl(hidden, w, b):
        logits = F.linear(hidden[:, :-1], w, b) / temperature
        return trl_selective_log_softmax(logits, ids) * mask, trl_entropy_from_logits(logits) * mask

    check_against(ours, trl, [hidden, w, b], upstream)
    logp, entropy = ours(hidden, w, b)
    assert logp.dtype == entropy.dtype == torch.float32
    assert (logp[~mask] == 0).all() and (entropy[~mask] == 0).all() and (logp[mask] < 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_trl_dpo_sequence_logps(dtype):
    """DPO's concatenated forward: per-token log-probs summed over the loss mask for chosen and rejected
    completions, and the sigmoid loss of their margins against a reference model's (a frozen second head). Flattened
    [B * T, H] rows, no bias, and the head a transposed [H, V] parameter (a non-contiguous weight)."""
    hidden, w, _ = head((4, 7), 16, dtype, seed=2, bias=False)
    w_ref = w.detach() + 0.1 * h.make(w.shape, dtype, seed=9)
    w_t = w.detach().t().contiguous().requires_grad_()
    ids, mask = completion(4, 6, seed=3)
    target = torch.where(mask, ids, IGNORE).reshape(-1)

    def dpo_loss(seq_logps):
        def loss(hidden, w_t):
            x, w = hidden[:, :-1].reshape(-1, hidden.shape[-1]), w_t.t()
            assert not w.is_contiguous()
            logps = seq_logps(x, w).view(4, 6).sum(-1)
            with torch.no_grad():
                ref_logps = seq_logps(x, w_ref.to(x.dtype)).view(4, 6).sum(-1)
            margins = (logps[:2] - ref_logps[:2]) - (logps[2:] - ref_logps[2:])  # chosen, then rejected
            return -F.logsigmoid(0.1 * margins).mean()

        return loss

    def ours(x, w):
        return fused.linear_log_probs(x, w, target)

    def trl(x, w):
        return trl_selective_log_softmax(F.linear(x, w), ids.reshape(-1)) * mask.reshape(-1)

    check_against(dpo_loss(ours), dpo_loss(trl), [hidden, w_t], [torch.ones(())])


def test_trl_log_probs_of_all_ignored_tokens():
    """A batch whose completions are all masked: every log-prob and entropy 0, gradients 0 (TRL's times its mask)."""
    hidden, w, b = head((2, 5), 8, torch.float32, seed=4)
    target = torch.full((2, 4), IGNORE)
    logp, entropy = fused.linear_log_probs(hidden[:, 1:], w, target, linear_bias=b, return_entropy=True)
    assert (logp == 0).all() and (entropy == 0).all()
    assert all((g == 0).all() for g in torch.autograd.grad((logp - entropy).sum(), [hidden, w, b]))


# ---- TRL: GKDTrainer.generalized_jsd_loss ----
def ours_as_generalized_jsd(x, w, b, xt, wt, bt, labels, beta, temperature, reduction):
    """generalized_jsd_loss(student logits, teacher logits, labels, beta, temperature, reduction) from ours,
    through the conversions of the module docstring (reduction "none": TRL's summed over the vocabulary)."""
    ours = {"batchmean": "mean" if labels is not None else "sum", "mean": "mean", "sum": "sum", "none": "none"}
    loss = fused.linear_distillation_loss(
        x, w, xt, wt, labels, student_bias=b, teacher_bias=bt, divergence=divergence_for(beta), beta=beta,
        temperature=temperature, reduction=ours[reduction],
    )  # fmt: skip
    if reduction == "batchmean" and labels is None:
        return loss / x.shape[0]
    if reduction == "mean":
        return loss / w.shape[0]
    return loss[labels != IGNORE] if reduction == "none" and labels is not None else loss


def generalized_jsd_of_heads(x, w, b, xt, wt, bt, labels, beta, temperature, reduction):
    with torch.no_grad():
        teacher_logits = F.linear(xt.to(x.dtype), wt.to(x.dtype), bt.to(x.dtype))
    loss = trl_generalized_jsd_loss(F.linear(x, w, b), teacher_logits, labels, beta, temperature, reduction)
    return loss.sum(-1) if reduction == "none" else loss


@pytest.mark.parametrize("dtype", h.FLOAT_DTYPES)
@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_trl_generalized_jsd_loss(dtype, beta):
    """GKD's loss on shifted [B, T, H] hidden states and labels (non-contiguous), teacher of another hidden size,
    temperature 0.9, labels with -100 (prompt and padding) and none, every reduction (in float32; "batchmean" and
    "none" with labels in 16 bits): loss and the gradients of student input, weight and bias (per-token upstream
    weights for "none")."""
    hidden, w, b = head((2, 7), 16, dtype, seed=1)
    t_hidden, wt, bt = (t.detach() for t in head((2, 7), 24, dtype, seed=11))
    ids, mask = completion(2, 6)
    masked = h.noncontiguous(torch.where(mask, ids, IGNORE))  # as GKD's labels[:, 1:]
    cases = [(masked, "batchmean"), (masked, "none")]
    if dtype == torch.float32:
        cases = [(labels, r) for labels in (masked, None) for r in ("batchmean", "sum", "mean", "none")]
    for labels, reduction in cases:
        tokens = (int(mask.sum()),) if labels is not None else (2, 6)  # TRL's "none" keeps the counted rows
        upstream = [h.make(tokens, seed=7, low=-2, high=2) if reduction == "none" else torch.ones(())]
        options = (labels, beta, 0.9, reduction)

        def ours(hidden, w, b):
            return ours_as_generalized_jsd(hidden[:, :-1], w, b, t_hidden[:, :-1], wt, bt, *options)

        def trl(hidden, w, b):
            return generalized_jsd_of_heads(hidden[:, :-1], w, b, t_hidden[:, :-1], wt, bt, *options)

        check_against(ours, trl, [hidden, w, b], upstream)


def identity_heads(student_logits, teacher_logits):
    """(input, weight) pairs whose linear layers give the logits exactly: TRL's tests take logits, ours heads."""
    eye = torch.eye(student_logits.shape[-1], dtype=student_logits.dtype)
    return student_logits, eye, teacher_logits, eye


def gkd(student_logits, teacher_logits, **kw):
    """ours_as_generalized_jsd on given logits (identity heads, no biases)."""
    options = dict(labels=None, beta=0.5, temperature=1.0, reduction="batchmean") | kw
    xs, ws, xt, wt = identity_heads(student_logits, teacher_logits)
    return ours_as_generalized_jsd(xs, ws, None, xt, wt, None, **options)


def test_trl_gkd_unit_tests():
    """TestGeneralizedJSDLoss: a uniform distribution and identical logits give 0; beta = 1 is KL(student ||
    teacher) and beta = 0 KL(teacher || student), as F.kl_div(reduction="batchmean") gives them; temperature and beta
    change the loss; beta = 0.5 is symmetric in student and teacher, beta = 0.1 is not; every reduction's shape.
    With beta converted (divergence_for) and each value checked against generalized_jsd_loss in float64, and its
    num_items_in_batch (the sum over a global count) as our "sum" divided by it."""
    student, teacher = (
        torch.log(torch.tensor([[0.1, 0.9]])).unsqueeze(0),
        torch.log(torch.tensor([[0.9, 0.1]])).unsqueeze(0),
    )
    beta_1 = F.kl_div(F.log_softmax(teacher, -1), F.softmax(student, -1), reduction="batchmean")
    beta_0 = F.kl_div(F.log_softmax(student, -1), F.softmax(teacher, -1), reduction="batchmean")
    for beta, want in ((1.0, beta_1), (0.0, beta_0)):
        assert abs(gkd(student, teacher, beta=beta).item() - want.item()) < 1e-6

    ones = torch.ones(1, 1, 5)
    assert abs(gkd(ones, ones).item()) < 1e-6
    s, t = h.make((2, 3, 5), seed=1), h.make((2, 3, 5), seed=2)
    assert abs(gkd(s, s).item()) < 1e-6
    assert gkd(s, t, beta=0.0) != gkd(s, t, beta=1.0)
    assert gkd(s, t, temperature=1.0) != gkd(s, t, temperature=2.0)
    h.assert_close(gkd(s, t, beta=0.5), gkd(t, s, beta=0.5))
    assert (gkd(s, t, beta=0.1) - gkd(t, s, beta=0.1)).abs() > 1e-3
    for reduction in ("batchmean", "sum", "mean"):
        assert gkd(s, t, reduction=reduction).shape == ()
    assert gkd(s, t, reduction="none").shape == (2, 3)  # TRL's (2, 3, 5) summed over the vocabulary
    s64, t64 = s.double(), t.double()
    for beta in (0.0, 0.1, 0.5, 1.0):
        for reduction in ("batchmean", "sum", "mean", "none"):
            want = trl_generalized_jsd_loss(s64, t64, beta=beta, temperature=2.0, reduction=reduction)
            got = gkd(s, t, beta=beta, temperature=2.0, reduction=reduction)
            h.assert_close(got, want.sum(-1) if reduction == "none" else want)
    accumulated = trl_generalized_jsd_loss(s64, t64, beta=0.3, num_items_in_batch=7)  # TRL divides the sum by it
    h.assert_close(gkd(s, t, beta=0.3, reduction="sum") / 7, accumulated)


def test_trl_gkd_all_tokens_ignored():
    """A batch whose completions were all truncated (every label -100): generalized_jsd_loss gives 0 ("batchmean"
    clamps its count at 1), and so do ours "mean" and "sum", with zero gradients; "none" is all zeros."""
    hidden, w, b = head((2, 5), 8, torch.float32, seed=3)
    t_hidden, wt, bt = (t.detach() for t in head((2, 5), 12, torch.float32, seed=13))
    labels = torch.full((2, 4), IGNORE)
    for beta in (0.0, 0.5, 1.0):
        for reduction in ("batchmean", "sum"):
            args = (hidden[:, :-1], w, b, t_hidden[:, :-1], wt, bt, labels, beta, 1.0, reduction)
            want = generalized_jsd_of_heads(*args)
            got = ours_as_generalized_jsd(*args)
            assert want == 0 and got == 0
            assert all((g == 0).all() for g in torch.autograd.grad(got, [hidden, w, b]))
        loss = fused.linear_distillation_loss(hidden[:, :-1], w, t_hidden[:, :-1], wt, labels, reduction="none")
        assert loss.shape == (2, 4) and (loss == 0).all()


# ---- Liger-Kernel: LigerFusedLinearJSDLoss (chunked_loss) and LigerFusedLinearJSD ----
@pytest.mark.parametrize("dtype", h.FLOAT_DTYPES)
@pytest.mark.parametrize(
    "temperature, weight_hard, weight_soft, beta, bias",
    [
        (1.0, 0.5, 0.5, 0.5, True),
        (2.0, 0.0, 1.0, 0.8, False),
        (0.5, 1.0, 0.0, 0.2, True),
        (1.0, 0.0, 1.0, 0.0, False),
        (1.0, 0.0, 1.0, 1.0, True),
    ],
)
def test_liger_chunked_jsd_loss(dtype, temperature, weight_hard, weight_soft, beta, bias):
    """test_jsd_loss.py's test_correctness (student of H // 2 = 16, teacher of 32, random ignored targets under
    ignore_index 42, weights of hard and soft loss, temperature), and its beta = 0 / 1 ends: Liger's loss is
    weight_hard * cross-entropy + weight_soft * ours "mean", the cross-entropy from fused.linear_log_probs
    (fused.linear_cross_entropy rounds its loss to the input's dtype, as torch). The
    backward through loss * 2 (Liger's grad_output != 1 path)."""
    x, w, b = head((21,), 16, dtype, seed=21, bias=bias)
    xt, wt, bt = (None if t is None else t.detach() for t in head((21,), 32, dtype, seed=31, bias=bias))
    target = torch.randint(0, V, (21,), generator=torch.Generator().manual_seed(4))
    target[torch.randperm(21, generator=torch.Generator().manual_seed(5))[:7]] = 42
    args = (beta, temperature, 42, weight_hard, weight_soft)

    def ours(x, w, b):
        soft = fused.linear_distillation_loss(
            x, w, xt, wt, target, student_bias=b, teacher_bias=bt, divergence=divergence_for(beta), beta=beta,
            temperature=temperature, ignore_index=42,
        )  # fmt: skip
        logp = fused.linear_log_probs(x, w, target, linear_bias=b, ignore_index=42)  # float32: the mean below too
        hard = -logp.sum() / (target != 42).sum()
        return 2 * (weight_hard * hard + weight_soft * soft)

    def liger(x, w, b):
        return 2 * liger_chunked_jsd_loss(x, w, b, xt.to(x.dtype), wt.to(x.dtype), _like(bt, x), target, *args)

    leaves = [x, w] + ([b] if bias else [])
    check_against(lambda x, w, b=None: ours(x, w, b), lambda x, w, b=None: liger(x, w, b), leaves, [torch.ones(())])


def _like(t, other):
    return None if t is None else t.to(other.dtype)


def test_liger_chunked_jsd_loss_all_ignored():
    """The distillation base clamps its count of valid tokens at 1: every target ignored gives 0, gradients 0."""
    x, w, b = head((6,), 8, seed=6)
    xt, wt, bt = (t.detach() for t in head((6,), 12, seed=16))
    target = torch.full((6,), 42)
    for beta in (0.0, 0.5, 1.0):
        want = liger_chunked_jsd_loss(x, w, b, xt, wt, bt, target, beta, 1.0, 42, 0.0, 1.0)
        got = fused.linear_distillation_loss(
            x, w, xt, wt, target, student_bias=b, teacher_bias=bt, divergence=divergence_for(beta), beta=beta,
            ignore_index=42,
        )  # fmt: skip
        assert want == 0 and got == 0
        assert all((g == 0).all() for g in torch.autograd.grad(got, [x, w, b]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "temperature, beta, ignore_index", [(1.0, 0.5, 2), (2.0, 0.1, 42), (1.0, 0.0, 2), (1.0, 1.0, 2)]
)
def test_liger_fused_linear_jsd(dtype, temperature, beta, ignore_index):
    """test_fused_linear_jsd.py's test_correctness and test_correctness_with_ignore_index (bias-free heads, student
    of H // 2, jsd_beta with 0 as forward and 1 as reverse KL, temperature 2, ignore_index inside the vocabulary):
    LigerFusedLinearJSD is our "mean", over every row when there are no labels."""
    x, w, _ = head((4, 5), 8, dtype, seed=41, bias=False)
    xt, wt, _ = (t.detach() for t in head((4, 5), 16, dtype, seed=51))
    label = torch.randint(0, V, (4, 5), generator=torch.Generator().manual_seed(6))
    label.view(-1)[::3] = ignore_index
    for target in (None, label):

        def ours(x, w):
            return fused.linear_distillation_loss(
                x, w, xt, wt, target, divergence=divergence_for(beta), beta=beta, temperature=temperature,
                ignore_index=ignore_index,
            )  # fmt: skip

        def liger(x, w):
            flat = None if target is None else target.reshape(-1)
            rows = (x.reshape(-1, x.shape[-1]), w, xt.reshape(-1, xt.shape[-1]).to(x.dtype), wt.to(x.dtype))
            return liger_fused_linear_jsd(*rows, flat, beta, ignore_index, temperature)

        check_against(ours, liger, [x, w], [torch.ones(())])


@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16])
def test_liger_fused_linear_jsd_amp(autocast_dtype):
    """test_fused_linear_jsd.py's test_amp: float32 heads, 16-bit hidden states, some targets ignored, loss and
    backward under torch.autocast; the float64 run (which autocast leaves alone) is the exact answer."""
    x = h.make((8, 16), autocast_dtype, seed=61, requires_grad=True)
    w = h.make((V, 16), low=-0.5, high=0.5, seed=62, requires_grad=True)
    xt, wt = h.make((8, 32), autocast_dtype, seed=63), h.make((V, 32), low=-0.3, high=0.3, seed=64)
    label = torch.randint(0, V, (8,), generator=torch.Generator().manual_seed(7))
    label[[1, 4, 5]] = IGNORE

    def autocast(fn):
        def run(x, w):
            with torch.autocast("cpu", dtype=autocast_dtype):
                return fn(x, w)

        return run

    def ours(x, w):
        return fused.linear_distillation_loss(x, w, xt, wt, label, divergence="jsd")

    def liger(x, w):
        return liger_fused_linear_jsd(x, w, xt.to(x.dtype), wt.to(x.dtype), label)

    check_against(autocast(ours), autocast(liger), [x, w], [torch.ones(())])


def test_liger_jsd_of_log_probs():
    """test_jsd.py: Liger's JSD takes the log-probs log_q (student) and log_p (teacher), for beta = 0.5, 0.1, 0 and 1;
    ours takes logits (identity heads), the log-probs' own logits: the same loss, and their gradient with respect to
    the logits, log_q's gradient through log_softmax. At beta = 0.5 swapping student and teacher leaves it unchanged."""
    logits_q, logits_p = h.make((12, V), seed=1, requires_grad=True), h.make((12, V), seed=2)
    eye = torch.eye(V)
    for beta in (0.5, 0.1, 0.0, 1.0):

        def ours(z):
            return fused.linear_distillation_loss(
                z, eye.to(z.dtype), logits_p, eye, divergence=divergence_for(beta), beta=beta
            )

        def liger(z):
            return liger_jsd(z.log_softmax(-1), logits_p.to(z.dtype).log_softmax(-1), beta=beta)

        check_against(ours, liger, [logits_q], [torch.ones(())])
    swapped = fused.linear_distillation_loss(logits_p, eye, logits_q.detach(), eye, divergence="jsd")
    h.assert_close(swapped, fused.linear_distillation_loss(logits_q, eye, logits_p, eye, divergence="jsd"))


# ---- bad input: the error names the op and the argument ----
def test_errors_of_ported_calls():
    """Calls the replaced libraries accept or that a port gets wrong: TRL's top-K index [..., K], TRL's
    "batchmean", Liger's teacher vocabulary padded beyond the student's, a flattened target for [B, T, H] input,
    int32 targets, NaN options, a student and weight of different dtypes."""
    x, w, b = head((2, 3), 8)
    xt, wt, _ = (t.detach() for t in head((2, 3), 6, seed=3))
    t = torch.randint(0, V, (2, 3))
    lp, kd = "fused.linear_log_probs", "fused.linear_distillation_loss"
    with h.raises(rf"{lp}: target must have shape \(2, 3\)"):
        fused.linear_log_probs(x, w, t.unsqueeze(-1).expand(2, 3, 4))  # selective_log_softmax's top-K gather
    with h.raises(rf"{lp}: target must have shape \(2, 3\)"):
        fused.linear_log_probs(x, w, t.reshape(-1))
    with h.raises(f"{lp}: target must hold int64"):
        fused.linear_log_probs(x, w, t.int())
    for temperature in (-1.0, math.nan):
        with h.raises(f"{lp}: temperature must be > 0"):
            fused.linear_log_probs(x, w, t, temperature=temperature)
    with h.raises(f"{lp}: linear_weight has dtype"):
        fused.linear_log_probs(x, w.bfloat16(), t)
    with h.raises(f"{lp}: linear_bias must be 1-D"):
        fused.linear_log_probs(x, w, t, linear_bias=b[:-1])
    with h.raises(f"{kd}: reduction must be 'none', 'mean' or 'sum', got 'batchmean'"):
        fused.linear_distillation_loss(x, w, xt, wt, t, reduction="batchmean")
    with h.raises(f"{kd}: teacher_weight must have the vocabulary of student_weight"):
        fused.linear_distillation_loss(x, w, xt, torch.cat([wt, wt[:5]]), t)
    with h.raises(rf"{kd}: target must have shape \(2, 3\)"):
        fused.linear_distillation_loss(x, w, xt, wt, t.reshape(-1))
    with h.raises(f"{kd}: beta must be in"):
        fused.linear_distillation_loss(x, w, xt, wt, t, divergence="jsd", beta=math.nan)
    with h.raises(f"{kd}: temperature must be > 0"):
        fused.linear_distillation_loss(x, w, xt, wt, t, temperature=0.0)
    with h.raises(f"{kd}: student_weight has dtype"):
        fused.linear_distillation_loss(x, w.double(), xt, wt, t)
