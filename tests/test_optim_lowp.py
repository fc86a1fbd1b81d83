"""16-bit training with the fused optimizers: master weights tracking an fp32 model trained by torch.optim, 16-bit
steps bit-identical to the fp32 step on the widened tensors, rounded, stochastic rounding (bit-exact against the
reference, unbiased, reproducible), fp32 gradient accumulation, fp16 overflow with fused.amp.GradScaler, and fp32
state through state_dict."""

import copy
import io
import math

import pytest
import torch

import fused
from fused.optim.reference import ReferenceOptimizer, stochastic_round_bf16
from tests.harness import adam_step_args

SHAPES = [(37, 5), (40000,), (3,)]
STEPS = 50


def params(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype).requires_grad_() for s in SHAPES]


def grads_for(ps, step, dtype):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g).to(dtype) for p in ps]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "name,hyper",
    [("AdamW", dict(lr=1e-3, weight_decay=0.1)), ("Adam", dict(lr=1e-3)), ("SGD", dict(lr=1e-2, momentum=0.9))],
)
def test_master_tracks_torch_fp32_for_50_steps(dtype, name, hyper):
    low = params(dtype)
    fp32 = [p.detach().float().requires_grad_() for p in low]  # the same starting values, in fp32
    opt = getattr(fused.optim, name)(low, master_weights=True, max_grad_norm=1.0, **hyper)
    ref = ReferenceOptimizer(name, fp32, max_grad_norm=1.0, **hyper)
    for step in range(STEPS):
        for p, q, g in zip(low, fp32, grads_for(low, step, dtype)):
            p.grad, q.grad = g, g.float()  # the 16-bit gradient, seen by both
        opt.step()
        ref.step()
    # the norm of the 16-bit gradients, returned in their dtype as torch's clip_grad_norm_ returns it
    assert opt.last_grad_norm.dtype == dtype
    torch.testing.assert_close(opt.last_grad_norm, ref.last_grad_norm.to(dtype))
    for p, q in zip(low, fp32):
        master = opt.state[p]["master_param"]
        torch.testing.assert_close(master, q.detach(), rtol=1e-5, atol=1e-5)
        assert torch.equal(p.detach(), master.to(dtype))  # each 16-bit param is its rounded master


def test_stochastic_rounding_matches_reference_bits():
    # SGD with lr a power of two on bf16 values: p - lr * g is exact in fp32, so only the rounding is tested.
    ps = params(torch.bfloat16)
    before = [p.detach().clone() for p in ps]
    gs = grads_for(ps, 0, torch.bfloat16)
    for p, g in zip(ps, gs):
        p.grad = g
    opt = fused.optim.SGD(ps, lr=2.0**-6, stochastic_rounding=True)
    torch.manual_seed(1234)
    seed = int(torch.randint(-(2**63), 2**63 - 1, (), dtype=torch.int64))  # the draw the step makes
    torch.manual_seed(1234)
    opt.step()
    for t, (p, b, g) in enumerate(zip(ps, before, gs)):
        exact = b.float() - 2.0**-6 * g.float()
        assert torch.equal(p.detach(), stochastic_round_bf16(exact, seed, t))
        if p.numel() > 1000:
            assert not torch.equal(p.detach(), exact.to(torch.bfloat16))  # not round-to-nearest


def test_stochastic_rounding_unbiased_and_reproducible():
    n = 200_000
    p = torch.ones(n, dtype=torch.bfloat16, requires_grad=True)
    target = 1.0 - 2.0**-10  # a quarter ulp below 1 in bf16: round-to-nearest gives 1.0 every time
    opt = fused.optim.SGD([p], lr=2.0**-10, stochastic_rounding=True)
    p.grad = torch.ones(n, dtype=torch.bfloat16)
    torch.manual_seed(0)
    opt.step()
    values = p.detach().double()
    assert set(values.unique().tolist()) == {1.0 - 2.0**-8, 1.0}
    assert abs(values.mean().item() - target) < 5 * 2.0**-8 / math.sqrt(n)  # 5 sigma of the mean
    # the same seed gives the same bits; another seed others
    q = torch.ones(n, dtype=torch.bfloat16, requires_grad=True)
    q.grad = p.grad.clone()
    opt_q = fused.optim.SGD([q], lr=2.0**-10, stochastic_rounding=True)
    torch.manual_seed(0)
    opt_q.step()
    assert torch.equal(p, q)
    with torch.no_grad():
        q.fill_(1.0)
    opt_q.step()
    assert not torch.equal(p, q)


def test_stochastic_rounding_keeps_fp32_state_and_special_values():
    ps = params(torch.bfloat16) + [torch.randn(7, requires_grad=True), torch.randn(6).half().requires_grad_()]
    opt = fused.optim.AdamW(ps, lr=1e-3, stochastic_rounding=True)
    for p, g in zip(ps, grads_for(ps, 0, torch.float32)):
        p.grad = g.to(p.dtype)
    opt.step()
    for p in ps:
        want = torch.float32 if p.dtype in (torch.bfloat16, torch.float32) else torch.float16
        assert opt.state[p]["exp_avg"].dtype == want and "master_param" not in opt.state[p]
    x = torch.tensor([math.inf, -math.inf, math.nan, 0.0, 3.0e38])
    r = stochastic_round_bf16(x, 7).float()
    assert r[0] == math.inf and r[1] == -math.inf and math.isnan(r[2]) and r[3] == 0


def test_stochastic_rounding_state_dict_stays_fp32():
    a = params(torch.bfloat16)
    opt = fused.optim.AdamW(a, stochastic_rounding=True)
    for p, g in zip(a, grads_for(a, 0, torch.bfloat16)):
        p.grad = g
    opt.step()
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    opt_b = fused.optim.AdamW([p.detach().clone().requires_grad_() for p in a], stochastic_rounding=True)
    opt_b.load_state_dict(torch.load(buf))
    for p, q in zip(a, opt_b.param_groups[0]["params"]):
        for k in ("exp_avg", "exp_avg_sq"):
            assert opt_b.state[q][k].dtype == torch.float32 and torch.equal(opt_b.state[q][k], opt.state[p][k])


@pytest.mark.parametrize("master", [True, False])
def test_fp32_accumulation_of_16_micro_batches(master):
    dtype = torch.bfloat16
    ps = params(dtype)
    fp32 = [p.detach().float().requires_grad_() for p in ps]
    opt = fused.optim.AdamW(ps, lr=1e-3, master_weights=master, max_grad_norm=1.0)
    ref = ReferenceOptimizer("AdamW", fp32, max_grad_norm=1.0, lr=1e-3)
    sums = [None] * len(ps)  # the fp32 sums, added in micro-batch order
    low_sums = [torch.zeros(p.shape, dtype=dtype) for p in ps]  # what accumulating in .grad would keep
    for micro in range(16):
        for i, (p, g) in enumerate(zip(ps, grads_for(ps, micro, dtype))):
            p.grad = g
            sums[i] = g.float() if sums[i] is None else sums[i] + g.float()
            low_sums[i] += g
        if micro < 15:  # the last micro-batch stays in .grad: step() adds it
            opt.accumulate_grads()
            assert all(p.grad is None for p in ps)
    for q, s in zip(fp32, sums):
        q.grad = s.clone()
    opt.step()
    ref.step()
    for p, q, s, low in zip(ps, fp32, sums, low_sums):
        assert torch.equal(opt._grad_acc[p], s)  # the buffer keeps the sum until the next accumulate_grads
        assert not torch.equal(low.float(), s)  # 16-bit accumulation would have lost bits
        got = opt.state[p]["master_param"] if master else p.detach().float()
        want = q.detach() if master else q.detach().to(dtype).float()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert not opt._acc_live and all(p.grad is None for p in ps)
    # the next round starts fresh sums (the buffers are overwritten, not added to)
    for p, g in zip(ps, grads_for(ps, 99, dtype)):
        p.grad = g
    opt.accumulate_grads()
    assert all(torch.equal(opt._grad_acc[p], g.float()) for p, g in zip(ps, grads_for(ps, 99, dtype)))


def test_fp16_overflow_is_skipped_with_master_weights():
    ps = params(torch.float16)
    opt = fused.optim.AdamW(ps, lr=1e-2, master_weights=True, max_grad_norm=1.0)
    scaler = fused.amp.GradScaler("cpu", init_scale=2.0**16)
    g = torch.Generator().manual_seed(3)
    weights = [torch.randn(p.shape, generator=g).clamp(-5, 5) * 0.15 for p in ps]  # scaled grads < 65504

    def backward(poison):
        loss = sum((p.float() * w).sum() for p, w in zip(ps, weights))
        scaler.scale(loss * (math.inf if poison else 1.0)).backward()

    backward(False)
    assert all(p.grad.isfinite().all() and p.grad.float().square().max() > 65504 for p in ps[:2])
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0**16 and float(opt.state[ps[0]]["step"]) == 1
    # the scaled fp16 gradients square past fp16's range; the norm is of the unscaled values, taken in fp32 and
    # returned in the gradients' dtype
    expected = torch.linalg.vector_norm(torch.cat([w.half().double().view(-1) for w in weights]))
    assert opt.last_grad_norm.dtype == torch.float16
    torch.testing.assert_close(opt.last_grad_norm, expected.half())
    before = [(p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()}) for p in ps]
    opt.zero_grad()
    backward(True)
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0**15
    for p, (value, state) in zip(ps, before):
        assert torch.equal(p.detach(), value)
        assert all(torch.equal(opt.state[p][k], v) for k, v in state.items())  # master, moments, step


def test_accumulate_grads_op_and_errors():
    accs = [torch.zeros(5), torch.zeros(3, 2)]
    grads = [torch.ones(5, dtype=torch.bfloat16), torch.full((3, 2), 0.5, dtype=torch.float16)]
    torch.ops.fused.accumulate_grads_(accs, grads, False)
    torch.ops.fused.accumulate_grads_(accs, grads, False)
    assert torch.equal(accs[0], torch.full((5,), 2.0)) and torch.equal(accs[1], torch.ones(3, 2))
    torch.ops.fused.accumulate_grads_(accs, grads, True)
    assert torch.equal(accs[0], torch.ones(5))
    with pytest.raises(RuntimeError, match="fused.accumulate_grads_: accs\\[0\\] must be Float"):
        torch.ops.fused.accumulate_grads_([torch.zeros(5, dtype=torch.bfloat16)], grads[:1], False)
    with pytest.raises(RuntimeError, match="fused.accumulate_grads_: accs has 1 tensors"):
        torch.ops.fused.accumulate_grads_(accs[:1], grads, False)


def test_step_rejects_fp32_state_with_fp32_mismatch():
    p = torch.randn(4)
    with pytest.raises(RuntimeError, match="fused.adam_step_: exp_avgs\\[0\\] has dtype"):
        torch.ops.fused.adam_step_(
            *adam_step_args([p], [torch.randn(4)], [torch.zeros(4, dtype=torch.float64)], [torch.zeros(4)])
        )


@pytest.mark.parametrize(
    "name,groups",
    [
        ("AdamW", [dict(lr=1e-2, weight_decay=0.1), dict(lr=3e-3, betas=(0.8, 0.99), weight_decay=0.0, eps=1e-6)]),
        ("SGD", [dict(lr=0.1, momentum=0.9), dict(lr=0.03, momentum=0.5, dampening=0.1, weight_decay=0.01)]),
    ],
)
def test_param_groups_update_in_one_call(name, groups, monkeypatch):
    ours = params(torch.float32)
    theirs = [p.detach().clone().requires_grad_() for p in ours]
    opt = getattr(fused.optim, name)(
        [dict(params=ours[:2], **groups[0]), dict(params=ours[2:], **groups[1])], lr=0.5, max_grad_norm=1.0
    )
    ref = getattr(torch.optim, name)(
        [dict(params=theirs[:2], **groups[0]), dict(params=theirs[2:], **groups[1])], lr=0.5, foreach=False
    )
    op_name = "adam_step_" if name == "AdamW" else "sgd_step_"
    op = getattr(torch.ops.fused, op_name)
    calls = []
    monkeypatch.setattr(torch.ops.fused, op_name, lambda *a: calls.append(1) or op(*a))
    for step in range(4):
        for p, q, g in zip(ours, theirs, grads_for(ours, step, torch.float32)):
            p.grad, q.grad = g, g.clone()
        opt.step()
        torch.nn.utils.clip_grad_norm_(theirs, 1.0)
        ref.step()
    assert len(calls) == 4  # one update call per step for both groups
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("poison", [False, True])
def test_unscale_after_accumulate_grads(poison):
    """scaler.unscale_ between accumulate_grads() and step(): the fp32 sums are unscaled (torch's unscale_ reads
    only .grad, which is empty), and an inf in any micro-batch still skips the step."""
    runs = []
    for unscale_first in (False, True):
        ps = params(torch.float16)
        opt = fused.optim.AdamW(ps, lr=1e-2, master_weights=True, max_grad_norm=1.0)
        scaler = fused.amp.GradScaler("cpu", init_scale=2.0**10)
        scaler.scale(torch.ones(()))  # creates the scale, as scaling the loss does
        for micro in range(3):  # two micro-batches in the fp32 buffers, the last one left in .grad
            for p, g in zip(ps, grads_for(ps, micro, torch.float32)):
                g = g * 2.0**10
                if poison and micro == 1:
                    g[0] = math.inf
                p.grad = g.half()
            if micro < 2:
                opt.accumulate_grads()
        if unscale_first:
            scaler.unscale_(opt)
            assert all(p.grad is None for p in ps)
        scaler.step(opt)
        scaler.update()
        runs.append((ps, opt, scaler))
    (ps, opt, scaler), (ps_u, opt_u, scaler_u) = runs
    assert scaler.get_scale() == scaler_u.get_scale() == (2.0**9 if poison else 2.0**10)
    if poison:
        assert all("step" not in opt_u.state[p] or float(opt_u.state[p]["step"]) == 0 for p in ps_u)
        assert all(torch.equal(p, q) for p, q in zip(ps_u, params(torch.float16)))
        return
    sums = [
        sum(grads_for(ps, m, torch.float32)[i].mul(2.0**10).half().float() for m in range(3)) / 2.0**10
        for i in range(len(ps))
    ]
    expected = torch.linalg.vector_norm(torch.cat([s.view(-1) for s in sums]))
    for o in (opt, opt_u):
        torch.testing.assert_close(o.last_grad_norm, expected, rtol=1e-6, atol=0)
    for p, q in zip(ps, ps_u):
        torch.testing.assert_close(opt_u.state[q]["master_param"], opt.state[p]["master_param"], rtol=1e-6, atol=0)


def test_state_dict_mid_accumulation_loses_nothing():
    """A checkpoint between micro-batches carries the fp32 sums: save, load into a fresh optimizer, finish the
    accumulation there, and the step equals the uninterrupted one."""
    dtype = torch.bfloat16
    ps, resumed = params(dtype), params(dtype)
    opt = fused.optim.AdamW(ps, lr=1e-3, master_weights=True)
    for micro in range(4):
        for p, g in zip(ps, grads_for(ps, micro, dtype)):
            p.grad = g
        opt.accumulate_grads()
        if micro == 1:
            buffer = io.BytesIO()
            torch.save(opt.state_dict(), buffer)
    opt.step()
    other = fused.optim.AdamW(resumed, lr=1e-3, master_weights=True)
    buffer.seek(0)
    other.load_state_dict(torch.load(buffer))
    for micro in range(2, 4):
        for p, g in zip(resumed, grads_for(resumed, micro, dtype)):
            p.grad = g
        other.accumulate_grads()
    other.step()
    for p, q in zip(ps, resumed):
        assert torch.equal(other.state[q]["master_param"], opt.state[p]["master_param"])
        assert torch.equal(p, q)
    assert "accumulated_grads" not in opt.state_dict()  # after the step nothing is pending
    torch.optim.AdamW(params(dtype), lr=1e-3).load_state_dict(other.state_dict())  # torch ignores the extra key


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "name,hyper",
    [
        ("AdamW", {}),
        ("AdamW", dict(max_grad_norm=0.5)),
        ("AdamW", dict(clip_value=0.3, maximize=True)),
        ("Adam", dict(amsgrad=True, weight_decay=0.1)),
        ("SGD", dict(momentum=0.9, nesterov=True, max_grad_norm=0.5)),
    ],
)
def test_16bit_step_is_the_fp32_step_rounded(dtype, name, hyper):
    """16-bit params, gradients and state are widened and rounded (to nearest) in registers by the update loops, and
    fp32 ones are used in place: a 16-bit step's bits are those of the fp32 step on the widened tensors, rounded,
    for the parameters, the clipped gradients written back and every state tensor (odd sizes: vector tails)."""
    ps = params(dtype)
    opt = getattr(fused.optim, name)(ps, lr=1e-2, **hyper)
    for step in range(3):
        for p, g in zip(ps, grads_for(ps, step, dtype)):
            p.grad = g
        opt.step()
    for p, g in zip(ps, grads_for(ps, 3, dtype)):
        p.grad = g
    wide = [p.detach().float().requires_grad_() for p in ps]
    for w, p in zip(wide, ps):
        w.grad = p.grad.float()
    ref = getattr(fused.optim, name)(wide, lr=1e-2, **hyper)
    ref.load_state_dict(copy.deepcopy(opt.state_dict()))  # a copy: loading shares "step", as torch.optim's does
    assert all(v.dtype == torch.float32 for w in wide for k, v in ref.state[w].items() if k != "step")
    opt.step()
    ref.step()
    for p, w in zip(ps, wide):
        assert torch.equal(p.detach(), w.detach().to(dtype))
        assert torch.equal(p.grad, w.grad.to(dtype))
        assert ref.state[w].keys() == opt.state[p].keys()
        for key, value in opt.state[p].items():
            if key != "step":
                assert value.dtype == dtype and torch.equal(value, ref.state[w][key].to(dtype)), key
