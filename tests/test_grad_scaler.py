"""fused.amp.GradScaler + fused optimizers against torch.amp.GradScaler + unscale_ + clip_grad_norm_ + torch.optim."""

import math

import pytest
import torch

import fused

SHAPES = [(31, 7), (40000,), (5,)]


def make(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).requires_grad_() for s in SHAPES]


def backward(scaler, params, step, poison=False):
    g = torch.Generator().manual_seed(100 + step)
    loss = sum((p * torch.randn(p.shape, generator=g)).sum() for p in params)
    if poison:
        loss = loss * math.inf
    scaler.scale(loss).backward()


def run_torch(params, steps, poison_at, max_norm, **scaler_kw):
    opt = torch.optim.AdamW(params, lr=1e-2, foreach=False)
    scaler = torch.amp.GradScaler("cpu", **scaler_kw)
    scales = []
    for step in range(steps):
        opt.zero_grad()
        backward(scaler, params, step, poison=step in poison_at)
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(params, max_norm)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales, opt, scaler


def run_fused(params, steps, poison_at, max_norm, scaler_cls=fused.amp.GradScaler, **scaler_kw):
    opt = fused.optim.AdamW(params, lr=1e-2, max_grad_norm=max_norm)
    scaler = scaler_cls("cpu", **scaler_kw)
    scales = []
    for step in range(steps):
        opt.zero_grad()
        backward(scaler, params, step, poison=step in poison_at)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales, opt, scaler


@pytest.mark.parametrize("scaler_cls", [fused.amp.GradScaler, torch.amp.GradScaler], ids=["fused", "torch"])
def test_matches_torch_with_skips_and_growth(scaler_cls):
    kw = dict(init_scale=2.0**10, growth_interval=3)
    ours, theirs = make(), make()
    scales, opt, scaler = run_fused(ours, 8, {1, 5}, 1.0, scaler_cls=scaler_cls, **kw)
    ref_scales, ref_opt, ref_scaler = run_torch(theirs, 8, {1, 5}, 1.0, **kw)
    assert scales == ref_scales and scales[1] == 2.0**9 and max(scales) > 2.0**9
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p, q, rtol=2e-5, atol=2e-6)
        assert float(opt.state[p]["step"]) == float(ref_opt.state[q]["step"]) == 6.0
    assert scaler.state_dict() == ref_scaler.state_dict()


def test_last_grad_norm_is_unscaled():
    ours = make()
    _, opt, _ = run_fused(ours, 1, set(), 1e9, init_scale=2.0**12)
    theirs = make()
    torch_scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
    backward(torch_scaler, theirs, 0)
    expected = torch.nn.utils.clip_grad_norm_(theirs, 1e9)
    torch.testing.assert_close(opt.last_grad_norm, expected, rtol=1e-5, atol=0)


def test_unscale_then_step():
    """The user unscales first (e.g. to look at the gradients): the fused step must not unscale again."""
    ours, theirs = make(), make()
    opt = fused.optim.AdamW(ours, lr=1e-2, max_grad_norm=1.0)
    scaler = fused.amp.GradScaler("cpu", init_scale=2.0**8)
    ref_opt = torch.optim.AdamW(theirs, lr=1e-2, foreach=False)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    for step in range(3):
        for s, ps, o in ((scaler, ours, opt), (ref_scaler, theirs, ref_opt)):
            o.zero_grad()
            backward(s, ps, step, poison=step == 1)
            s.unscale_(o)
        torch.nn.utils.clip_grad_norm_(theirs, 1.0)
        scaler.step(opt)
        ref_scaler.step(ref_opt)
        scaler.update()
        ref_scaler.update()
    assert scaler.get_scale() == ref_scaler.get_scale() == 2.0**7
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p, q, rtol=2e-5, atol=2e-6)


def test_disabled_and_other_optimizers_fall_back_to_torch():
    params = make()
    opt = torch.optim.SGD(params, lr=0.1)
    scaler = fused.amp.GradScaler("cpu", init_scale=4.0)
    backward(scaler, params, 0)
    before = [p.detach().clone() for p in params]
    scaler.step(opt)
    scaler.update()
    assert not any(torch.equal(p, b) for p, b in zip(params, before))
    off = fused.amp.GradScaler("cpu", enabled=False)
    assert off.scale(torch.tensor(3.0)).item() == 3.0


def test_step_twice_is_an_error():
    params = make()
    opt = fused.optim.SGD(params, lr=0.1)
    scaler = fused.amp.GradScaler("cpu")
    backward(scaler, params, 0)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match="step\\(\\) has already been called"):
        scaler.step(opt)


@pytest.mark.parametrize("scaler_cls", [fused.amp.GradScaler, torch.amp.GradScaler], ids=["fused", "torch"])
@pytest.mark.parametrize(
    "name,hyper", [("SGD", dict(momentum=0.9)), ("Adam", dict(maximize=True)), ("AdamW", dict(weight_decay=0.1))]
)
def test_grad_after_step_as_torch_fused_leaves_it(scaler_cls, name, hyper):
    """After scaler.step(opt), .grad holds the unscaled gradient, as torch's fused=True optimizer with torch's scaler
    leaves it; a skipped step (inf/NaN) writes nothing, so .grad stays scaled there, as torch's fused ones leave it."""
    ours, theirs = make(), make()
    opt = getattr(fused.optim, name)(ours, lr=1e-2, **hyper)
    ref = getattr(torch.optim, name)(theirs, lr=1e-2, fused=True, **hyper)
    scaler, ref_scaler = scaler_cls("cpu", init_scale=2.0**10), torch.amp.GradScaler("cpu", init_scale=2.0**10)
    for step in range(3):
        for s, ps, o in ((scaler, ours, opt), (ref_scaler, theirs, ref)):
            o.zero_grad()
            backward(s, ps, step)
            if step == 1:
                ps[0].grad[3, 2] = math.inf
            s.step(o)
            s.update()
        for p, q in zip(ours, theirs):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)
    assert scaler.get_scale() == ref_scaler.get_scale() == 2.0**9


def test_scaler_step_hook():
    """The optimizers' one public hook for scalers: a step on gradients carrying a scale (found_inf returned, None
    without gradients); with unscale_by, the accumulate_grads() sums unscaled in place (None when .grad is what
    step() reads)."""
    ours, theirs = make(), make()
    opt, ref = fused.optim.Adam(ours, lr=1e-2), torch.optim.Adam(theirs, lr=1e-2, foreach=False)
    assert opt.scaler_step(torch.tensor(4.0)) is None  # no gradients yet
    scale = torch.tensor(2.0**5)
    for step in range(2):
        backward(fused.amp.GradScaler("cpu", init_scale=scale.item()), ours, step)
        backward(torch.amp.GradScaler("cpu", init_scale=1.0), theirs, step)
        found = opt.scaler_step(scale)
        ref.step()
        assert found.dtype == torch.float32 and found.item() == 0.0
        for p, q in zip(ours, theirs):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=0)
            torch.testing.assert_close(p, q, rtol=2e-5, atol=2e-6)
        opt.zero_grad()
        ref.zero_grad()
    backward(fused.amp.GradScaler("cpu", init_scale=scale.item()), ours, 5)
    backward(torch.amp.GradScaler("cpu", init_scale=1.0), theirs, 5)
    assert opt.scaler_step(unscale_by=1 / scale) is None  # .grad: the scaler's own unscale_ does it
    opt.accumulate_grads()
    found = opt.scaler_step(found_inf=torch.zeros(()), unscale_by=1 / scale)
    assert found.item() == 0.0
    assert opt.scaler_step(None, found).item() == 0.0  # the sums are unscaled: a step with no scale
    ref.step()
    for p, q in zip(ours, theirs):
        assert p.grad is None
        torch.testing.assert_close(p, q, rtol=2e-5, atol=2e-6)
    assert opt.scaler_step(torch.tensor(1.0), torch.ones(())) is None  # no gradients left


@pytest.mark.parametrize("scaler_cls", [fused.amp.GradScaler, torch.amp.GradScaler], ids=["fused", "torch"])
def test_scaler_step_runs_optimizer_step_hooks_and_scheduler_tracking(scaler_cls):
    """Both scalers go through optimizer.step(), as torch's drives optimizers: step pre/post hooks run, an LR
    scheduler sees the step (no "lr_scheduler.step() before optimizer.step()" warning), wrappers of step are
    called, and scaler.step(opt, None) passes the closure slot on as torch's does."""
    import warnings

    params = make()
    opt = fused.optim.AdamW(params, lr=1e-2)
    calls = []
    opt.register_step_pre_hook(lambda *a: calls.append("pre"))
    opt.register_step_post_hook(lambda *a: calls.append("post"))
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
    scaler = scaler_cls("cpu", init_scale=2.0**8)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        for step in range(2):
            opt.zero_grad()
            backward(scaler, params, step, poison=step == 1)
            scaler.step(opt, None)
            scaler.update()
            sched.step()
    assert calls == ["pre", "post"] * 2
    assert scaler.get_scale() == 2.0**7  # the inf of step 1 came back from the fused step's finite check
    with pytest.raises(RuntimeError, match="[Cc]losure"):
        scaler.step(opt, closure=lambda: None)
