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


# ---- torch's own GradScaler tests, ported (pytorch v2.13, device-generic since the CPU scaler):
# test/test_torch.py TestTorchDeviceType: test_grad_scale_will_not_overflow, test_pickle_gradscaler,
# test_params_invalidated_with_grads_invalidated_between_unscale_and_step, test_grad_scaling_state_dict;
# test/test_cuda.py: test_grad_scaling_scale, test_grad_scaler_with_preset_grad_scale, test_grad_scaling_unscale_sparse;
# and what torch.amp.GradScaler's docstrings state (update(new_scale), closures, a disabled scaler, the step of an
# optimizer without gradients). The scaling harness cases (clipping, penalty, accumulation, multiple optimizers,
# autocast) run in tests/test_optim_torch_ported.py with the fused optimizers; here with torch.optim's.
SCALER_CLASSES = [pytest.param(torch.amp.GradScaler, id="torch"), pytest.param(fused.amp.GradScaler, id="fused")]
TORCH_OPTIMIZERS = [
    pytest.param(name, flags, id=f"{name}-{'-'.join(flags) or 'for_loop'}")
    for name in ("SGD", "Adam", "AdamW")
    for flags in ({}, {"foreach": True}, {"fused": True})
]


def one_param_step(scaler, opt_cls, preset=None, **opt_kw):
    """torch's preset-grad-scale case: a weight of ones with a gradient of 15, a scale of 5."""
    w = torch.ones(5, 5, requires_grad=True)
    w.grad = torch.full_like(w, 15.0)
    opt = opt_cls([w], lr=0.1, **opt_kw)
    scaler.scale(torch.ones(5))
    if preset is not None:
        opt.grad_scale = preset
    scaler.step(opt)
    return w, opt


@pytest.mark.parametrize("scaler_cls", SCALER_CLASSES)
@pytest.mark.parametrize("opt", ["torch", "fused"])
def test_preset_grad_scale_multiplies_the_scalers(scaler_cls, opt):
    """test_cuda.py test_grad_scaler_with_preset_grad_scale: a grad_scale the user set on an optimizer that takes the
    scale in its step multiplies the scaler's (15 / (5 * 3) = 1 after the step); the attribute is consumed."""
    opt_cls, kw = (torch.optim.Adam, dict(fused=True)) if opt == "torch" else (fused.optim.Adam, {})
    w, o = one_param_step(scaler_cls("cpu", init_scale=5.0), opt_cls, preset=torch.tensor([3.0]), **kw)
    assert torch.equal(w.grad, torch.ones(5, 5))
    assert not hasattr(o, "grad_scale") and not hasattr(o, "found_inf")
    w, _ = one_param_step(scaler_cls("cpu", init_scale=5.0), opt_cls, **kw)  # without one: the scaler's alone
    assert torch.equal(w.grad, torch.full((5, 5), 3.0))


@pytest.mark.parametrize("scaler_cls", SCALER_CLASSES)
def test_step_without_gradients_as_torch(scaler_cls):
    """An optimizer that takes the scale in its step, without gradients: step() runs (nothing to update) and counts
    as the step, so a second step() refuses, and update() finds no inf check to read, as torch's scaler with
    torch's fused Adam."""
    for opt in (torch.optim.Adam([torch.ones(3, requires_grad=True)], fused=True), fused.optim.Adam([torch.ones(3)])):
        scaler = scaler_cls("cpu")
        scaler.scale(torch.ones(()))
        scaler.step(opt)
        with pytest.raises(RuntimeError, match="step\\(\\) has already been called since the last update"):
            scaler.step(opt)
        with pytest.raises(AssertionError, match="No inf checks were recorded prior to update"):
            scaler.update()


def scaling_run(scaler, opt_cls, opt_kw, steps=5, clip=False, closure=False, seed=0):
    """torch's _create_scaling_case model and data (two 8x8 linears, MSE), trained with `scaler`; an inf at step 2,
    a NaN at step 3; clip: unscale_ then clip_grad_norm_ (0.2) before the step. Returns params, optimizer state,
    the step results and the scales."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    data = [(torch.randn(8, 8), torch.randn(8, 8)) for _ in range(steps)]
    opt = opt_cls(model.parameters(), lr=0.1, **opt_kw)
    results, scales = [], []
    for i, (x, target) in enumerate(data):
        opt.zero_grad()
        scaler.scale(torch.nn.functional.mse_loss(model(x), target)).backward()
        if i in (2, 3):
            model[1].weight.grad[1, 2] = math.inf if i == 2 else math.nan
        if clip:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.2, error_if_nonfinite=False)
        results.append(scaler.step(opt, (lambda: torch.tensor(float(i))) if closure else None))
        scaler.update()
        scales.append(scaler.get_scale())
    return list(model.parameters()), opt.state_dict()["state"], results, scales


@pytest.mark.parametrize("name,flags", TORCH_OPTIMIZERS)
@pytest.mark.parametrize("clip", [False, True], ids=["step", "unscale_clip_step"])
def test_torch_optimizers_bit_identical_to_torch_scaler(name, flags, clip):
    """Plain torch.optim optimizers (for-loop, foreach, fused) under fused.amp.GradScaler step bit for bit as under
    torch.amp.GradScaler: params, optimizer state, the step's return (a positional closure's value, None where
    skipped) and the scales through an inf and a NaN step, with and without unscale_ + clip_grad_norm_."""
    closure = not flags.get("fused")  # torch's fused optimizers take no closure
    kw = dict(init_scale=2.0**10, growth_interval=2)
    ours = scaling_run(fused.amp.GradScaler("cpu", **kw), getattr(torch.optim, name), flags, clip=clip, closure=closure)
    theirs = scaling_run(
        torch.amp.GradScaler("cpu", **kw), getattr(torch.optim, name), flags, clip=clip, closure=closure
    )
    for p, q in zip(ours[0], theirs[0]):
        assert torch.equal(p, q) and torch.equal(p.grad, q.grad)
    torch.testing.assert_close(ours[1], theirs[1], rtol=0, atol=0)
    assert ours[2:] == theirs[2:]
    assert ours[3][2] == ours[3][1] / 2 and ours[3][3] == ours[3][2] / 2  # the inf and NaN steps backed off


@pytest.mark.parametrize("scaler_cls", SCALER_CLASSES)
def test_sparse_gradients_of_torch_optimizers(scaler_cls):
    """test_grad_scaling_unscale_sparse's case through a whole step: an nn.Embedding(sparse=True) trained by
    torch.optim.SGD under the scaler equals torch's scaler bit for bit; an inf in a sparse gradient skips the step."""
    runs = []
    for cls in (scaler_cls, torch.amp.GradScaler):
        torch.manual_seed(0)
        emb = torch.nn.Embedding(10, 4, sparse=True)
        opt, scaler = torch.optim.SGD(emb.parameters(), lr=0.1), cls("cpu", init_scale=4.0)
        for step in range(3):
            opt.zero_grad()
            scaler.scale(emb(torch.tensor([1, 2, 2, 5])).pow(2).sum()).backward()
            if step == 1:
                emb.weight.grad = torch.sparse_coo_tensor([[3]], [[math.inf] * 4], (10, 4), check_invariants=True)
            before = emb.weight.detach().clone()
            scaler.step(opt)
            scaler.update()
            assert torch.equal(emb.weight, before) == (step == 1)
        runs.append((emb.weight.detach(), scaler.get_scale()))
    assert torch.equal(runs[0][0], runs[1][0]) and runs[0][1] == runs[1][1] == 2.0


@pytest.mark.parametrize("scaler_cls", SCALER_CLASSES)
@pytest.mark.parametrize("opt_name", ["SGD", "Adam"])
def test_params_invalidated_between_unscale_and_step(scaler_cls, opt_name):
    """test_torch.py test_params_invalidated_with_grads_invalidated_between_unscale_and_step: gradients broken
    (inf / NaN) after unscale_ reach torch.optim's parameters (the scaler checked before they broke). A contract
    choice of the fused optimizers (README: a step under a scaler that sees inf/NaN is skipped whole): theirs
    checks the gradients it reads, so the step is skipped and the parameters stay as they were; fused.amp.GradScaler
    reads that check back and backs off, torch's scaler keeps the check unscale_ made."""
    for opt_cls in (getattr(torch.optim, opt_name), getattr(fused.optim, opt_name)):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
        opt, scaler = opt_cls(model.parameters(), lr=1.0), scaler_cls("cpu", init_scale=128.0)
        x, target = torch.randn(8, 8), torch.randn(8, 8)
        before = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        scaler.scale(torch.nn.functional.mse_loss(model(x), target)).backward()
        scaler.unscale_(opt)
        for j, p in enumerate(model.parameters()):  # deliberately break the gradients
            p.grad.fill_(math.inf if j % 2 else math.nan)
        scaler.step(opt)
        scaler.update()
        if opt_cls.__module__.startswith("torch"):  # torch's assertion
            assert all(p.isnan().any() or p.isinf().any() for p in model.parameters())
            assert scaler.get_scale() == 128.0
        else:
            assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
            assert float(opt.state[model[0].weight].get("step", 0.0)) == 0.0  # SGD keeps no step count
            assert scaler.get_scale() == (64.0 if scaler_cls is fused.amp.GradScaler else 128.0)


@pytest.mark.parametrize("scaler_cls", SCALER_CLASSES)
@pytest.mark.parametrize("opt_cls", [torch.optim.Adam, fused.optim.Adam], ids=["torch", "fused"])
def test_grad_scale_will_not_overflow(scaler_cls, opt_cls):
    """test_torch.py test_grad_scale_will_not_overflow: a scale of 1e38 growing by 16 every step stays finite."""
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 1)
    opt = opt_cls(model.parameters())
    scaler = scaler_cls("cpu", growth_interval=1, growth_factor=2.0**4, init_scale=1e38)
    loss = ((model(torch.randn(1, 5)) - 1e-30 * torch.randn(1, 1)) ** 2).mean()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    assert math.isfinite(scaler.get_scale())


def test_scale_nested_outputs():
    """test_cuda.py test_grad_scaling_scale: scale() of a tensor and of nested tuples and lists of them; a number
    is refused with torch's message."""
    scaler = fused.amp.GradScaler("cpu", init_scale=2.0)
    t0, t1 = torch.full((1,), 4.0), torch.full((1,), 8.0)
    assert torch.equal(scaler.scale(t1), torch.full((1,), 16.0))
    outputs = scaler.scale((t1.clone(), (t0.clone(), t1.clone()), [t0.clone(), (t1.clone(), t0.clone())]))
    assert isinstance(outputs[2], list) and isinstance(outputs[1], tuple)
    flat = [outputs[0], *outputs[1], outputs[2][0], *outputs[2][1]]
    assert [t.item() for t in flat] == [16.0, 8.0, 16.0, 8.0, 16.0, 8.0]
    with pytest.raises(ValueError, match="outputs must be a Tensor or an iterable of Tensors"):
        scaler.scale(4.0)


@pytest.mark.parametrize("opt_cls", [torch.optim.SGD, fused.optim.SGD], ids=["torch", "fused"])
def test_update_with_new_scale(opt_cls):
    """update(new_scale): a float or a one-element tensor (copied: later changes to it do not reach the scaler);
    anything else is refused with torch's message."""
    p = torch.ones(3, requires_grad=True)
    opt, scaler = opt_cls([p], lr=1.0), fused.amp.GradScaler("cpu", init_scale=4.0)

    def step():
        opt.zero_grad()
        scaler.scale(p.sum()).backward()
        scaler.step(opt)

    step()
    scaler.update(2.5)
    assert scaler.get_scale() == 2.5
    step()
    new = torch.tensor(7.0)
    scaler.update(new)
    new.fill_(9.0)
    assert scaler.get_scale() == 7.0
    step()
    for bad in (torch.tensor([1.0, 2.0]), torch.tensor(3.0, requires_grad=True)):
        with pytest.raises(AssertionError, match="new_scale should be a float or a 1-element"):
            scaler.update(bad)


@pytest.mark.parametrize("direction", ["torch_to_fused", "fused_to_torch"])
def test_state_dict_loads_across_scalers(direction):
    """A torch.amp.GradScaler state dict (mid-training: a backed-off scale, a growth tracker) loads into
    fused.amp.GradScaler and back, and the loaded scaler trains on as the original."""
    source_cls, target_cls = (
        (torch.amp.GradScaler, fused.amp.GradScaler)
        if direction == "torch_to_fused"
        else (fused.amp.GradScaler, torch.amp.GradScaler)
    )
    kw = dict(init_scale=2.0**10, growth_factor=4.0, backoff_factor=0.25, growth_interval=3)
    source = source_cls("cpu", **kw)
    scaling_run(source, fused.optim.AdamW, {})
    loaded = target_cls("cpu", init_scale=6.0, growth_factor=7.0, backoff_factor=0.8, growth_interval=1)
    loaded.load_state_dict(source.state_dict())
    assert loaded.state_dict() == source.state_dict() and loaded.state_dict()["_growth_tracker"] > 0
    a, b = scaling_run(source, fused.optim.AdamW, {}, seed=1), scaling_run(loaded, fused.optim.AdamW, {}, seed=1)
    assert a[3] == b[3] and all(torch.equal(p, q) for p, q in zip(a[0], b[0]))


@pytest.mark.parametrize("lazy_init_scale", [True, False])
def test_pickle(lazy_init_scale):
    """test_torch.py test_pickle_gradscaler: a pickled scaler keeps its settings, a fresh per-optimizer state and,
    once initialised, its scale."""
    import pickle

    a = fused.amp.GradScaler("cpu", init_scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2)
    if lazy_init_scale:
        a.scale(torch.tensor([4.0]))
    b = pickle.loads(pickle.dumps(a))
    assert type(b) is fused.amp.GradScaler and b.is_enabled()
    assert (b.get_scale(), b.get_growth_factor(), b.get_backoff_factor(), b.get_growth_interval()) == (3.0, 4.0, 0.5, 2)
    assert b._per_optimizer_states["any"] == torch.amp.grad_scaler._refresh_per_optimizer_state()
    if lazy_init_scale:
        assert b.scale(torch.tensor([4.0])).item() == 12.0


@pytest.mark.parametrize("opt_cls", [torch.optim.SGD, fused.optim.SGD], ids=["torch", "fused"])
def test_closure_as_torch(opt_cls):
    """A closure by keyword is refused while the scaler is enabled (RuntimeError, as torch's), and passed on when it
    is disabled; a disabled scaler changes nothing: scale() and unscale_() leave values as they are, step() is the
    optimizer's, update() keeps the scale at 1 and state_dict() is empty."""
    p = torch.ones(3, requires_grad=True)
    opt = opt_cls([p], lr=1.0)
    on = fused.amp.GradScaler("cpu", init_scale=4.0)
    on.scale(p.sum()).backward()
    with pytest.raises(RuntimeError, match="[Cc]losure use is not"):
        on.step(opt, closure=lambda: torch.tensor(2.0))
    opt.zero_grad()
    off = fused.amp.GradScaler("cpu", enabled=False)
    off.scale(p.sum()).backward()
    off.unscale_(opt)
    assert torch.equal(p.grad, torch.ones(3))
    assert off.step(opt, closure=lambda: torch.tensor(2.0)).item() == 2.0
    off.update()
    assert torch.equal(p.detach(), torch.zeros(3)) and off.get_scale() == 1.0 and off.state_dict() == {}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the warning is for a machine without CUDA")
def test_cuda_scaler_without_cuda_warns_and_disables():
    """torch's scaler for "cuda" on a machine without CUDA warns and disables itself; ours inherits it."""
    with pytest.warns(UserWarning, match="CUDA is not available.  Disabling"):
        scaler = fused.amp.GradScaler("cuda")
    assert not scaler.is_enabled()
