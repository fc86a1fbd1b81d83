"""Cases ported from torch's and apex's own test suites, run against fused.optim with both torch.amp.GradScaler and
fused.amp.GradScaler. Each test names the case it ports. Besides the source's own assertion, numbers are judged
against a float64 run: our error no worse than torch's on the same inputs, x2 (harness.assert_accuracy).

Sources (pytorch at v2.13, apex master):
- pytorch test/test_torch.py (TestTorchDeviceType, device-generic since the CPU GradScaler): test_grad_scaling_unscale,
  test_grad_scaling_state_dict, test_grad_scaling_autocast (+ pickling), test_grad_scaling_clipping,
  test_grad_scaling_clipping_separate_unscale, test_grad_scaling_penalty, test_grad_scaling_accumulation,
  test_grad_scaling_multiple, test_grad_scaling_autocast_fused_optimizers; their helpers _create_scaling_case and
  _create_scaling_models_optimizers (torch/testing/_internal/common_cuda.py) and _run_scaling_case.
- pytorch test/test_cuda.py: test_grad_scaling_unscale_sparse (sparse gradients: a contract choice, refused).
- pytorch test/test_nn.py (TestNNDeviceType, run there with float64 as the default dtype): test_clip_grad_norm,
  test_clip_grad_norm_error_if_nonfinite.
- apex tests/L0/run_optimizers/test_fused_optimizer.py (TestFusedAdam, TestFusedSGD: test_float, test_half,
  test_bfloat16, test_adam_option; 278011 elements there, 27801 here), test_adam.py (test_double,
  test_multi_params with sizes / 10), and apex's
  AdamTest (testNative, testGradScaler, testStateDict: an autocast model against torch.optim.Adam, 100 steps there,
  10 here on the CPU).

Contract choices shown here: sparse gradients are refused by name; after accumulate_grads() .grad is None (the
sums are the optimizer's); a skipped step leaves .grad as torch's fused=True optimizers leave it (scaled).
"""

import copy
import itertools
import math
import pickle

import pytest
import torch
from harness import SEEDS, assert_accuracy, assert_accuracy_over_seeds, raises
from torch import nn

import fused

SCALERS = [pytest.param(torch.amp.GradScaler, id="torch_scaler"), pytest.param(fused.amp.GradScaler, id="fused_scaler")]
SCALER_NO_PICKLE = [pytest.param(p.values[0], False, id=p.id) for p in SCALERS]
OPTIMS = [
    pytest.param("SGD", dict(momentum=0.9, nesterov=True), id="SGD-nesterov"),
    pytest.param("Adam", dict(amsgrad=True), id="Adam-amsgrad"),
    pytest.param("AdamW", dict(weight_decay=0.1), id="AdamW"),
]


# ---- torch's grad-scaling harness (test_torch.py, common_cuda.py), with a float64 control added ----
def create_scaling_case(seed=0):
    """_create_scaling_case: two 8x8 linears, four (input, target) batches, an inf injected at iteration 2."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    data = [(torch.randn(8, 8), torch.randn(8, 8)) for _ in range(4)]
    return model, data, nn.MSELoss(), 2


RUN_LABELS = ("torch_control", "exact", "theirs", "ours_control", "ours")


class Run:
    """One training run of a case: its model, optimizer and data (float64 for the reference run)."""

    def __init__(self, model, data, opt_cls, hyper, dtype=torch.float32):
        self.model = copy.deepcopy(model).to(dtype)
        self.data = [(x.to(dtype), y.to(dtype)) for x, y in data]
        self.opt = opt_cls(self.model.parameters(), **{"lr": 1.0, **hyper})  # torch's helper: lr=1.0

    def params(self):
        return list(self.model.parameters())


def assert_close_as_torch(ours, ours_control, theirs, torch_control, atol, rtol=1e-5, msg=None):
    """The source's check: the scaled run against its unscaled control (the same optimizer) within (atol, rtol).
    Where torch's own pair misses that tolerance too (fp16 autocast moves lr=1.0 Adam parameters by more than its
    1e-3), ours is no further from its control than torch's from its, x2."""
    try:
        torch.testing.assert_close(ours, ours_control, atol=atol, rtol=rtol, msg=msg)
    except AssertionError:
        ours_dev = (ours - ours_control).abs().max().item()
        torch_dev = (theirs - torch_control).abs().max().item()
        assert ours_dev <= 2 * torch_dev, f"{msg or ''} {ours_dev:.3e} from the control, torch's {torch_dev:.3e}"


def scaling_runs(run, name, hyper, scaler_cls, enabled, seed=0, labels=RUN_LABELS, ours_kw=None):
    """The runs of one case (torch's case for seed 0), trained by `run`: fused.optim with `scaler_cls` ("ours"),
    torch.optim with torch's scaler, the unscaled controls and the float64 run ("exact"), as `labels` picks.
    Returns the runs and ours's scaler."""
    torch_cls, fused_cls = getattr(torch.optim, name), getattr(fused.optim, name)
    ctors = {
        "torch_control": (lambda ps, **kw: torch_cls(ps, foreach=False, **kw), torch.float32),
        "exact": (lambda ps, **kw: torch_cls(ps, foreach=False, **kw), torch.float64),
        "theirs": (lambda ps, **kw: torch_cls(ps, foreach=False, **kw), torch.float32),
        "ours_control": (lambda ps, **kw: fused_cls(ps, **kw, **(ours_kw or {})), torch.float32),
        "ours": (lambda ps, **kw: fused_cls(ps, **kw, **(ours_kw or {})), torch.float32),
    }
    model, data, loss_fn, skip_iter = create_scaling_case(seed)
    runs = {label: Run(model, data, ctors[label][0], hyper, ctors[label][1]) for label in labels}
    scaler = None
    for label, r in runs.items():
        cls = scaler_cls if label == "ours" else torch.amp.GradScaler
        s = cls("cpu", init_scale=128.0, growth_factor=2.0, enabled=enabled, growth_interval=1)
        s = run(r.data, r.model, r.opt, s, loss_fn, skip_iter, label in ("theirs", "ours")) or s
        scaler = s if label == "ours" else scaler
    return runs, scaler


def flat(tensors):
    return torch.cat([t.detach().flatten() for t in tensors])


def accuracy_samples(runs_per_seed, labels=("ours", "theirs", "exact")):
    """(ours, theirs, exact) per seed: every parameter of a run in one vector, and every .grad in another (none
    where the case ends on zero_grad())."""
    params = [tuple(flat(runs[k].params()) for k in labels) for runs in runs_per_seed]
    grads = [
        tuple(flat(p.grad for p in runs[k].params()) for k in labels)
        for runs in runs_per_seed
        if runs["exact"].params()[0].grad is not None
    ]
    return params, grads


def run_scaling_case(run, name, hyper, scaler_cls, unskipped, skipped, atol=1e-7, ours_kw=None):
    """_run_scaling_case, for enabled in (True, False): a control run without scaling against the same training with
    scaling, with one optimizer class for both as there: fused.optim with `scaler_cls` (and torch.optim with torch's
    scaler alongside). Asserts torch's, on torch's case: the scale after the growths and backoffs, and the scaled
    run's params, .grad and state against its control within atol (assert_close_as_torch). Adds: the scaled fused
    run's error against a float64 run is no worse than torch.optim's scaled run's, x2, judged over SEEDS cases (four
    steps at lr=1.0 are chaotic: assert_accuracy_over_seeds)."""
    for enabled in (True, False):
        runs, scaler = scaling_runs(run, name, hyper, scaler_cls, enabled, ours_kw=ours_kw)
        if enabled:
            growth = scaler.get_growth_factor() ** unskipped if unskipped > 0 else 1.0
            backoff = scaler.get_backoff_factor() ** skipped if skipped > 0 else 1.0
            assert scaler.get_scale() == 128.0 * growth * backoff
        else:
            assert scaler.get_scale() == 1.0
        params = zip(*(runs[k].params() for k in ("ours", "ours_control", "theirs", "torch_control")))
        for s, c, t, tc in params:
            assert_close_as_torch(s.grad, c.grad, t.grad, tc.grad, atol)
            for k in runs["torch_control"].opt.state[tc]:  # the state torch keeps, in the four runs
                states = [
                    runs[label].opt.state[p][k]
                    for label, p in (("ours", s), ("ours_control", c), ("theirs", t), ("torch_control", tc))
                ]
                assert_close_as_torch(*states, atol, msg=k)
            assert_close_as_torch(s.detach(), c.detach(), t.detach(), tc.detach(), atol)
        if enabled:  # the scaled run judged against float64 (the unscaled one is the same optimizer step)
            runs_per_seed = [runs] + [
                scaling_runs(run, name, hyper, scaler_cls, enabled, seed, ("ours", "theirs", "exact"), ours_kw)[0]
                for seed in range(1, SEEDS)
            ]
            for samples in accuracy_samples(runs_per_seed):
                if samples:
                    assert_accuracy_over_seeds(samples)


def inject_inf(model):
    with torch.no_grad():
        model[1].weight.grad.fill_(math.inf)


def backward_and_step(
    i, loss, model, optimizer, scaler, skip_iter, try_scaling_api, before_inf=None, after_inf=None, control=None
):
    """The tail of torch's run() bodies: backward (of the scaled loss in the scaled run), the inf injected into the
    scaled run at skip_iter, the step, which the control leaves out at skip_iter as the scaler skips it there.
    before_inf / after_inf: what the scaled run does around the injection; control: what the control does before
    its step."""
    if try_scaling_api:
        scaler.scale(loss).backward()
        if before_inf:
            before_inf()
        if i == skip_iter and scaler.is_enabled():
            inject_inf(model)
        if after_inf:
            after_inf()
        scaler.step(optimizer)
        scaler.update()
    else:
        loss.backward()
        if control:
            control()
        if not scaler.is_enabled() or i != skip_iter:
            optimizer.step()


def clipping_loop(data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api, max_norm, **hooks):
    """The run() loop of torch's two clipping tests, whose checks both keep: zero_grad, the loss, then
    backward_and_step with the scaled run's hooks, the control clipping its gradients at max_norm."""
    for i, (x, target) in enumerate(data):
        optimizer.zero_grad()
        loss = loss_fn(model(x), target)
        control = lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)  # noqa: E731
        backward_and_step(i, loss, model, optimizer, scaler, skip_iter, try_scaling_api, control=control, **hooks)


@pytest.mark.parametrize(
    "scaler_cls,try_pickle", SCALER_NO_PICKLE + [pytest.param(fused.amp.GradScaler, True, id="fused_scaler-pickled")]
)
@pytest.mark.parametrize("name,hyper", OPTIMS)
def test_grad_scaling_autocast(scaler_cls, try_pickle, name, hyper):
    """test_torch.py test_grad_scaling_autocast: no scaling and no autocast against scaling + fp16 autocast (atol
    1e-3 as there: fp32 against a mix of fp16 and fp32); with try_pickle the scaler goes through pickle each step."""

    def run(data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        for i, (x, target) in enumerate(data):
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16, enabled=try_scaling_api):
                loss = loss_fn(model(x), target)
            backward_and_step(i, loss, model, optimizer, scaler, skip_iter, try_scaling_api)
            if try_scaling_api and try_pickle:
                scaler = pickle.loads(pickle.dumps(scaler))
        return scaler

    run_scaling_case(run, name, hyper, scaler_cls, unskipped=3, skipped=1, atol=1e-3)


@pytest.mark.parametrize("scaler_cls", SCALERS)
@pytest.mark.parametrize("name,hyper", OPTIMS)
@pytest.mark.parametrize("clip", ["torch", "fused", "max_grad_norm"])
def test_grad_scaling_clipping(scaler_cls, name, hyper, clip):
    """test_torch.py test_grad_scaling_clipping: the scaled gradients clipped at max_norm * scale before the step
    (torch's or fused.clip_grad_norm_), or, ours only, the optimizer's max_grad_norm on the unscaled ones; .grad
    after the step equals the control's clipped gradient."""
    max_norm = 0.2  # a value that clips, as there

    def run(data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        clip_fn = fused.clip_grad_norm_ if clip == "fused" else torch.nn.utils.clip_grad_norm_

        def clip_scaled():
            if getattr(optimizer, "max_grad_norm", None) is None:  # else the fused step clips
                clip_fn(model.parameters(), max_norm * scaler.get_scale())

        clipping_loop(
            data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api, max_norm, before_inf=clip_scaled
        )

    ours_kw = dict(max_grad_norm=max_norm) if clip == "max_grad_norm" else None
    run_scaling_case(run, name, hyper, scaler_cls, unskipped=3, skipped=1, atol=1e-5, ours_kw=ours_kw)


@pytest.mark.parametrize("scaler_cls", SCALERS)
@pytest.mark.parametrize("name,hyper", OPTIMS)
@pytest.mark.parametrize("clip", ["torch", "fused"])
def test_grad_scaling_clipping_separate_unscale(scaler_cls, name, hyper, clip):
    """test_torch.py test_grad_scaling_clipping_separate_unscale: unscale_, clip at max_norm, step."""
    max_norm = 0.2
    clip_fn = fused.clip_grad_norm_ if clip == "fused" else torch.nn.utils.clip_grad_norm_

    def run(data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        def unscale_and_clip():
            scaler.unscale_(optimizer)
            clip_fn(model.parameters(), max_norm)

        clipping_loop(
            data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api, max_norm, after_inf=unscale_and_clip
        )

    run_scaling_case(run, name, hyper, scaler_cls, unskipped=3, skipped=1)


@pytest.mark.parametrize("scaler_cls", SCALERS)
@pytest.mark.parametrize("name,hyper", OPTIMS)
def test_grad_scaling_penalty(scaler_cls, name, hyper):
    """test_torch.py test_grad_scaling_penalty: a gradient-norm penalty from autograd.grad of the scaled loss."""

    def run(data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        for i, (x, target) in enumerate(data):
            optimizer.zero_grad()
            loss = loss_fn(model(x), target)
            if try_scaling_api:
                grad_params = torch.autograd.grad(scaler.scale(loss), model.parameters(), create_graph=True)
                grad_params = [p * (1.0 / scaler.get_scale()) for p in grad_params]
            else:
                grad_params = torch.autograd.grad(loss, model.parameters(), create_graph=True)
            loss = loss + sum(g.pow(2).sum() for g in grad_params).sqrt()
            backward_and_step(i, loss, model, optimizer, scaler, skip_iter, try_scaling_api)

    run_scaling_case(run, name, hyper, scaler_cls, unskipped=3, skipped=1)


@pytest.mark.parametrize("scaler_cls", SCALERS)
@pytest.mark.parametrize("name,hyper", OPTIMS)
def test_grad_scaling_accumulation(scaler_cls, name, hyper):
    """test_torch.py test_grad_scaling_accumulation: two micro-batches accumulated in .grad per step."""

    def run(data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        iters_to_accumulate = 2
        for i, (x, target) in enumerate(data):
            loss = loss_fn(model(x), target) / iters_to_accumulate
            (scaler.scale(loss) if try_scaling_api else loss).backward()
            if (i + 1) % iters_to_accumulate == 0:
                if try_scaling_api:
                    scaler.step(optimizer)
                    scaler.update()
                else:
                    optimizer.step()
                optimizer.zero_grad()

    run_scaling_case(run, name, hyper, scaler_cls, unskipped=2, skipped=0)


@pytest.mark.parametrize("name,hyper", OPTIMS[:2])
def test_grad_scaling_accumulation_with_accumulate_grads(name, hyper):
    """The same accumulation through opt.accumulate_grads() (fp32 sums held by the optimizer) gives the parameters
    of accumulating in .grad. Contract choices shown: .grad is None after such a step (the sums are internal), and
    the sums need fused.amp.GradScaler: torch's scaler checks .grad alone, finds none, and its update() refuses."""
    model, data, loss_fn, _ = create_scaling_case()
    results = []
    for use_sums in (False, True):
        r = Run(model, data, lambda ps, **kw: getattr(fused.optim, name)(ps, **kw), hyper)
        scaler = fused.amp.GradScaler("cpu", init_scale=128.0, growth_factor=2.0, growth_interval=1)
        for i, (x, target) in enumerate(r.data):
            scaler.scale(loss_fn(r.model(x), target) / 2).backward()
            if use_sums:
                r.opt.accumulate_grads()
            if i % 2 == 1:
                scaler.step(r.opt)
                scaler.update()
                assert all((p.grad is None) == use_sums for p in r.params())
                r.opt.zero_grad()
        assert scaler.get_scale() == 512.0
        results.append(r.params())
    for p, q in zip(*results):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(loss_fn(r.model(data[0][0]), data[0][1])).backward()
    r.opt.accumulate_grads()
    scaler.step(r.opt)
    with pytest.raises(AssertionError, match="No inf checks were recorded prior to update"):
        scaler.update()


@pytest.mark.parametrize("scaler_cls", SCALERS)
@pytest.mark.parametrize("name,hyper", OPTIMS)
def test_grad_scaling_multiple(scaler_cls, name, hyper):
    """test_torch.py test_grad_scaling_multiple: two models, two optimizers, one scaler, two losses each reaching
    both models; one optimizer unscaled separately before its step; the inf goes into model1 only. Checked as
    _run_scaling_case checks (assert_close_as_torch, float64 judgement)."""
    torch_cls, fused_cls = getattr(torch.optim, name), getattr(fused.optim, name)

    def train(enabled, seed, labels):
        """Each label's two runs, trained; ours's scaler. Torch's case for seed 0."""
        model0, data, loss_fn, skip_iter = create_scaling_case(2 * seed)
        model1, _, _, _ = create_scaling_case(2 * seed + 1)
        runs, scalers = {}, {}
        for label in labels:
            cls, kw = (fused_cls, {}) if label.startswith("ours") else (torch_cls, dict(foreach=False))
            dtype = torch.float64 if label == "exact" else torch.float32
            runs[label] = [Run(m, data, lambda ps, **k: cls(ps, **kw, **k), hyper, dtype) for m in (model0, model1)]
            scalers[label] = (scaler_cls if label == "ours" else torch.amp.GradScaler)(
                "cpu", init_scale=128.0, growth_factor=2.0, enabled=enabled, growth_interval=1
            )

        for label, (r0, r1) in runs.items():
            scaler, try_scaling_api = scalers[label], label in ("theirs", "ours")
            for i, (x, target) in enumerate(r0.data):
                r0.opt.zero_grad()
                r1.opt.zero_grad()
                out0, out1 = r0.model(x), r1.model(x)
                loss0 = loss_fn(0.3 * out0 + 0.7 * out1, target)
                loss1 = loss_fn(0.6 * out0 - 0.4 * out1, target)
                if try_scaling_api:
                    scaler.scale(loss0).backward(retain_graph=True)
                    scaler.scale(loss1).backward()
                    if i == skip_iter and scaler.is_enabled():
                        inject_inf(r1.model)
                    scaler.unscale_(r0.opt)  # as there: one optimizer unscaled separately
                    scaler.step(r0.opt)
                    scaler.step(r1.opt)
                    scaler.update()
                else:  # the inf goes into model1's gradients only: optimizer0 steps every time
                    loss0.backward(retain_graph=True)
                    loss1.backward()
                    r0.opt.step()
                    if not scaler.is_enabled() or i != skip_iter:
                        r1.opt.step()
        return runs, scalers["ours"]

    labels = ("ours", "ours_control", "theirs", "torch_control", "exact")
    for enabled in (True, False):
        runs, scaler = train(enabled, 0, labels)
        assert scaler.get_scale() == (
            128.0 * scaler.get_growth_factor() ** 3 * scaler.get_backoff_factor() if enabled else 1.0
        )
        for s, c, t, tc in zip(*(itertools.chain(runs[k][0].params(), runs[k][1].params()) for k in labels[:4])):
            assert_close_as_torch(s.detach(), c.detach(), t.detach(), tc.detach(), atol=1e-7)
            assert_close_as_torch(s.grad, c.grad, t.grad, tc.grad, atol=1e-7)
        if not enabled:
            continue
        runs_per_seed = [runs] + [train(enabled, seed, ("ours", "theirs", "exact"))[0] for seed in range(1, SEEDS)]
        assert_accuracy_over_seeds(
            [
                tuple(flat(runs[k][0].params() + runs[k][1].params()) for k in ("ours", "theirs", "exact"))
                for runs in runs_per_seed
            ]
        )


@pytest.mark.parametrize("scaler_cls", SCALERS)
@pytest.mark.parametrize("name", ["SGD", "Adam", "AdamW"])
@pytest.mark.parametrize("separate_unscale", [False, True])
def test_grad_scaling_autocast_fused_optimizers(scaler_cls, name, separate_unscale):
    """test_torch.py test_grad_scaling_autocast_fused_optimizers: torch.optim (not fused) with torch's scaler
    against the fused optimizer with the scaler (one scaler shared by both, as there), under fp16 autocast, with or
    without a separate unscale_: losses, .grad, params and state equal at every step (default tolerances)."""
    model, data, loss_fn, _ = create_scaling_case()
    control = Run(model, data, lambda ps, **kw: getattr(torch.optim, name)(ps, foreach=False, **kw), {})
    ours = Run(model, data, lambda ps, **kw: getattr(fused.optim, name)(ps, **kw), {})
    scaler = scaler_cls("cpu", init_scale=128.0)
    for x, target in data:
        losses = []
        for r, separate in ((control, False), (ours, separate_unscale)):
            r.opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.half):
                loss = loss_fn(r.model(x), target)
            losses.append(loss)
            scaler.scale(loss).backward()
            if separate:
                scaler.unscale_(r.opt)
            scaler.step(r.opt)
            scaler.update()
        torch.testing.assert_close(losses[1], losses[0])
        for c, s in zip(control.params(), ours.params()):
            torch.testing.assert_close(s.grad, c.grad)
            torch.testing.assert_close(s, c)
            for k, v in control.opt.state[c].items():
                torch.testing.assert_close(ours.opt.state[s][k].reshape(v.shape), v, msg=k)


@pytest.mark.parametrize("scaler_cls", SCALERS)
def test_grad_scaling_unscale(scaler_cls):
    """test_torch.py test_grad_scaling_unscale: the "perfect storm" of gradients (dense, strided [:, :5], fp32 and
    fp16) unscaled by the scaler's _unscale_grads_, an inf injected into each in turn; then, ours only, the fused step
    on the same gradients: .grad unscaled (all ones) after it, or left alone when it is skipped."""
    inv_scale, g = torch.full((1,), 0.25), torch.full((20, 20), 4.0)

    def perfect_storm_grads(inject_inf):
        grads = [g.clone(), g.clone()[:, :5], g.to(dtype=torch.float16), g.to(dtype=torch.float16)]
        if inject_inf >= 0:
            grads[inject_inf][2, 2] = math.inf
        return grads

    scaler = scaler_cls("cpu")
    params = [
        torch.zeros_like(t, memory_format=torch.contiguous_format).requires_grad_() for t in perfect_storm_grads(-1)
    ]
    opt = fused.optim.SGD(params, lr=1.0)
    for inject_inf in range(-1, len(params)):
        found_inf = torch.full((1,), 0.0)
        grads = perfect_storm_grads(inject_inf)
        for p, grad in zip(params, grads):
            p.grad = grad
        found = scaler._unscale_grads_(opt, inv_scale, found_inf, True)
        assert sum(v.item() for v in found.values()) == (inject_inf >= 0)
        if inject_inf < 0:
            for grad in grads:
                torch.testing.assert_close(grad, torch.ones_like(grad), rtol=1e-5, atol=1e-7)
    # the fused step unscales in its own update pass and writes the unscaled gradients back, in their layouts
    scaler = scaler_cls("cpu", init_scale=4.0)
    scaler.scale(torch.ones(()))
    for inject_inf in (-1, 1):
        grads = perfect_storm_grads(inject_inf)
        for p, grad in zip(params, grads):
            p.grad = grad
        before = [p.detach().clone() for p in params]
        scaler.step(opt)
        scaler.update()
        for p, grad, b, found in zip(params, grads, before, perfect_storm_grads(inject_inf)):
            assert p.grad is grad
            if inject_inf < 0:
                torch.testing.assert_close(grad, torch.ones_like(grad), rtol=0, atol=0)
                torch.testing.assert_close(p.detach(), b - 1.0)
            else:  # skipped whole: params as they were, .grad as the step found it
                assert torch.equal(p.detach(), b) and torch.equal(grad, found)


@pytest.mark.parametrize("scaler_cls", SCALERS)
def test_grad_scaling_unscale_sparse(scaler_cls):
    """test_cuda.py test_grad_scaling_unscale_sparse unscales sparse gradients for torch's optimizers; the fused
    optimizers take dense gradients only (a contract choice): refused by name, nothing changed."""
    p = torch.zeros(5, requires_grad=True)
    p.grad = torch.sparse_coo_tensor([[1, 3]], [8.0, 16.0], (5,))
    opt = fused.optim.SGD([p], lr=1.0)
    scaler = scaler_cls("cpu", init_scale=8.0)
    scaler.scale(torch.ones(()))
    with raises("fused.optim.SGD: sparse gradients are not supported"):
        scaler.step(opt)
    assert torch.equal(p.detach(), torch.zeros(5))


@pytest.mark.parametrize("scaler_cls", SCALERS)
def test_grad_scaling_state_dict(scaler_cls):
    """test_torch.py test_grad_scaling_state_dict: a scaler's state dict loads into another, lazily initialised
    or not; the loaded one drives a fused step with the loaded scale."""
    for lazy_init_scale in (True, False):
        s0 = scaler_cls("cpu", init_scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2)
        s1 = scaler_cls("cpu", init_scale=6.0, growth_factor=7.0, backoff_factor=0.8, growth_interval=1)
        s1._init_growth_tracker = 7  # a value for load_state_dict to overwrite
        if lazy_init_scale:
            s1.scale(torch.full((1,), 4.0))
            assert s1._scale.dtype == torch.float32
        s1.load_state_dict(s0.state_dict())
        assert (
            s1.get_scale(),
            s1.get_growth_factor(),
            s1.get_backoff_factor(),
            s1.get_growth_interval(),
            s1._init_growth_tracker,
        ) == (3.0, 4.0, 0.5, 2, 0)
        p = torch.zeros(3, requires_grad=True)
        p.grad = torch.full((3,), 6.0)
        s1.scale(torch.ones(()))
        s1.step(fused.optim.SGD([p], lr=1.0))
        assert torch.equal(p.grad, torch.full((3,), 2.0)) and torch.equal(p.detach(), torch.full((3,), -2.0))


# ---- torch's clip_grad_norm_ tests (test_nn.py), where float64 is the default dtype ----
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("norm_type", [0.5, 1.5, 2, 4, "inf"])
@pytest.mark.parametrize("foreach", [False, True])
def test_clip_grad_norm(dtype, norm_type, foreach):
    """test_nn.py test_clip_grad_norm: the norm before equals the returned norm, the norm after equals max_norm,
    every gradient scaled by one factor; small gradients left unchanged; a single tensor taken; an exhausted
    generator warns."""
    layer = nn.Linear(10, 10).to(dtype)
    max_norm = 2

    def compute_norm(norm_type):
        norm_type = float(norm_type)
        if norm_type != math.inf:
            return sum(p.grad.abs().pow(norm_type).sum() for p in layer.parameters()) ** (1.0 / norm_type)
        return max(p.grad.abs().max() for p in layer.parameters())

    def compare_scaling(grads):
        scale = torch.cat([p.grad.div(g).view(-1) for p, g in zip(layer.parameters(), grads)])
        torch.testing.assert_close(scale.std(), torch.zeros((), dtype=dtype), atol=1e-6, rtol=0)
        return scale[0]

    grads = torch.arange(1.0, 101, dtype=dtype).view(10, 10), torch.ones(10, dtype=dtype).div(1000)
    for p, g in zip(layer.parameters(), grads):
        p.grad = g.clone().view_as(p)
    norm_before = compute_norm(norm_type)
    norm = fused.clip_grad_norm_(layer.parameters(), max_norm, norm_type=norm_type, foreach=foreach)
    norm_after = compute_norm(norm_type)
    assert norm.dtype == dtype
    torch.testing.assert_close(norm, norm_before)
    torch.testing.assert_close(norm_after, torch.tensor(float(max_norm), dtype=dtype))
    assert norm_after <= norm_before
    compare_scaling(grads)

    grads = torch.rand(10, 10, dtype=dtype).div(10000), torch.ones(10, dtype=dtype).div(500)
    for p, g in zip(layer.parameters(), grads):
        p.grad.copy_(g)
    norm_before = compute_norm(norm_type)
    norm = fused.clip_grad_norm_(layer.parameters(), max_norm, norm_type=norm_type, foreach=foreach)
    norm_after = compute_norm(norm_type)
    torch.testing.assert_close(norm, norm_before)
    torch.testing.assert_close(norm_before, norm_after)
    assert norm_after <= max_norm
    assert compare_scaling(grads) == 1

    p1, p2 = torch.randn(10, 10, dtype=dtype), torch.randn(10, 10, dtype=dtype)
    g = torch.arange(1.0, 101, dtype=dtype).view(10, 10)
    p1._grad, p2._grad = g.clone(), g.clone()
    fused.clip_grad_norm_(p1, max_norm, norm_type=norm_type, foreach=foreach)
    fused.clip_grad_norm_([p2], max_norm, norm_type=norm_type, foreach=foreach)
    assert torch.equal(p1.grad, p2.grad)

    params = layer.parameters()
    for _ in params:
        pass
    with pytest.warns(UserWarning, match="`parameters` is an empty generator, no gradient clipping will occur."):
        fused.clip_grad_norm_(params, max_norm, norm_type=norm_type, foreach=foreach)


@pytest.mark.parametrize("foreach", [True])  # the fused kernels ignore it; orders <= 0 pass it to torch
def test_clip_grad_norm_error_if_nonfinite(foreach):
    """test_nn.py test_clip_grad_norm_error_if_nonfinite: float64 gradients of inf, NaN, 2e22 and 2e200 (finite
    in float64 for some orders only), orders 0, negative, positive and inf; an error exactly where the total norm
    is not finite and error_if_nonfinite=True, and then the gradients unchanged."""
    norms_pos = [0.1, 1, 2, 3.5, math.inf]
    norms_neg = [-0.1, -1, -2, -3.5]
    norms_except_0 = norms_pos + norms_neg
    norms_all = norms_except_0 + [0]
    # (grad_only_one_elem, prefix_finite_grad_param, scalars, norms_nonfinite, norms_finite)
    test_cases = [
        (False, False, [math.inf, -math.inf], norms_except_0, [0]),
        (False, True, [math.inf, -math.inf], norms_pos, norms_neg + [0]),
        (True, False, [math.inf, -math.inf], norms_pos, norms_neg + [0]),
        (True, True, [math.inf, -math.inf], norms_pos, norms_neg + [0]),
        (False, False, [math.nan], norms_except_0, [0]),
        (False, True, [math.nan], norms_except_0, [0]),
        (True, False, [math.nan], norms_except_0, [0]),
        (True, True, [math.nan], norms_except_0, [0]),
        (False, False, [2e22, -2e22], [], norms_all),
        (False, True, [2e22, -2e22], [], norms_all),
        (True, False, [2e22, -2e22], [], norms_all),
        (True, True, [2e22, -2e22], [], norms_all),
        (False, False, [2e200, -2e200], [3.5, 2, -2, -3.5], [math.inf, 1, 0.1, 0, -1, -0.1]),
        (False, True, [2e200, -2e200], [3.5, 2], norms_neg + [math.inf, 1, 0.1, 0]),
        (True, False, [2e200, -2e200], [3.5, 2], norms_neg + [math.inf, 1, 0.1, 0]),
        (True, True, [2e200, -2e200], [3.5, 2], norms_neg + [math.inf, 1, 0.1, 0]),
    ]

    def gen_parameters(scalar, grad_only_one_elem, prefix_finite_grad_param):
        param = torch.ones(10, dtype=torch.float64, requires_grad=True)
        (param[1] if grad_only_one_elem else param).mul(scalar).sum().backward()
        if not prefix_finite_grad_param:
            return [param]
        prefix = torch.ones(1, dtype=torch.float64, requires_grad=True)
        prefix.mul(1).sum().backward()
        return [prefix, param]

    for grad_only_one_elem, prefix, scalars, norms_nonfinite, norms_finite in test_cases:
        for error_if_nonfinite in (False, True):
            cases = [(n, s, True) for n, s in itertools.product(norms_nonfinite, scalars)]
            cases += [(n, s, False) for n, s in itertools.product(norms_finite, scalars)]
            for norm_type, scalar, nonfinite in cases:
                parameters = gen_parameters(scalar, grad_only_one_elem, prefix)
                if nonfinite and error_if_nonfinite:
                    before = [p.grad.clone() for p in parameters]
                    with pytest.raises(RuntimeError, match=f"The total norm of order {float(norm_type)} for gradients"):
                        fused.clip_grad_norm_(
                            parameters, 1, norm_type=norm_type, error_if_nonfinite=True, foreach=foreach
                        )
                    for p, b in zip(parameters, before):
                        torch.testing.assert_close(p.grad, b, equal_nan=True)
                else:
                    fused.clip_grad_norm_(
                        parameters, 1, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite, foreach=foreach
                    )


# ---- apex's fused-optimizer tests (tests/L0/run_optimizers) ----
def apex_single_type_case(name, options, dtype, nelem=27801, iters=7, sizes=None):
    """apex gen_single_type_test / test_multi_params (nelem: apex's 278011 / 10): torch.rand params, torch.rand_like
    grads each step, the reference torch.optim against the fused one: apex's max abs diff <= 1e-3 and max rel diff
    <= 1 (in 16 bits that is one ulp or less of the values: two roundings of equally good updates differ by that,
    so there the float64 judgement alone). Also judged against torch.optim run on float64 copies of the same values:
    our error no worse than the reference's, x2. The 16-bit Adam reference is torch's fused=True (fp32 math, as
    ours): torch's for-loop Adam in fp16 underflows to NaN (why apex skips its assertion there); torch's fused SGD
    in fp16 on the CPU moves the parameters wrongly (torch 2.13), so SGD's is the for-loop one."""
    torch.manual_seed(9876)
    tensors = [torch.rand(s, dtype=dtype) for s in (sizes or [(nelem,)])]
    ref = [nn.Parameter(t.clone()) for t in tensors]
    tst = [nn.Parameter(t.clone()) for t in tensors]
    exact = [nn.Parameter(t.double()) for t in tensors]
    low = dtype in (torch.float16, torch.bfloat16)
    impl = dict(fused=True) if low and name == "Adam" else dict(foreach=False)
    ref_opt = getattr(torch.optim, name)(ref, **impl, **options)
    tst_opt = getattr(fused.optim, name)(tst, **options)
    exact_opt = getattr(torch.optim, name)(exact, foreach=False, **options)
    for _ in range(iters):
        for r, t, e in zip(ref, tst, exact):
            r.grad = torch.rand_like(r)
            t.grad, e.grad = r.grad.clone(), r.grad.double()
        ref_opt.step()
        tst_opt.step()
        exact_opt.step()
        for r, t in zip(ref, tst):
            if not low:
                assert (r - t).abs().max().item() <= 1e-3
                assert not ((r - t) / r).abs().max().item() > 1  # apex's comparison: NaN (0 / 0) passes
    for r, t, e in zip(ref, tst, exact):
        assert_accuracy(t.detach(), r.detach(), e.detach())


ADAM_OPTIONS = dict(lr=5e-4, betas=(0.9, 0.999), eps=1e-08, weight_decay=0, amsgrad=False)


@pytest.mark.parametrize(
    "name,options",
    [("Adam", ADAM_OPTIONS), ("SGD", dict(lr=0.25, momentum=0.125))],
    ids=["TestFusedAdam", "TestFusedSGD"],
)
@pytest.mark.parametrize(
    "dtype",
    [torch.float32, torch.float16, torch.bfloat16, torch.float64],
    ids=["test_float", "test_half", "test_bfloat16", "test_double"],
)
def test_apex_single_type(name, options, dtype):
    """apex test_fused_optimizer.py / test_adam.py: test_float, test_half, test_bfloat16, test_double."""
    apex_single_type_case(name, options, dtype)


def test_apex_adam_option_and_multi_params():
    """apex test_adam_option (one element, betas (0.6, 0.9), eps 3e-6) and test_multi_params (apex's sizes / 10)."""
    apex_single_type_case(
        "Adam", dict(lr=0.01, betas=(0.6, 0.9), eps=3e-06, weight_decay=0, amsgrad=False), torch.float32, nelem=1
    )
    apex_single_type_case(
        "Adam", ADAM_OPTIONS, torch.float32, sizes=[(410, 102), (410,), (410, 205), (3232, 102), (1,)]
    )


class ApexModel(nn.Module):
    """apex's AdamTest model (conv, pool, three linears), smaller: 1x14x14 inputs."""

    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 6, 3), nn.Conv2d(6, 8, 3)
        self.fc1, self.fc2, self.fc3 = nn.Linear(128, 24), nn.Linear(24, 16), nn.Linear(16, 10)

    def forward(self, x):
        y = nn.functional.max_pool2d(torch.relu(self.conv1(x)), 2)
        y = torch.relu(self.conv2(y)).reshape(x.shape[0], -1)
        return torch.relu(self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(y))))))


@pytest.mark.parametrize("scaler_cls", [None] + SCALERS)
def test_apex_adam_native_and_grad_scaler(scaler_cls):
    """apex AdamTest testNative / testGradScaler / testStateDict: torch.optim.Adam (+ torch's scaler under fp16
    autocast) against the fused Adam (+ the scaler), the fused model reset to the reference's weights before every
    step as there: weights and .grad within apex's 1e-3 each step, and the optimizers' state dicts alike."""
    torch.manual_seed(0)
    model, model_ = ApexModel(), ApexModel()
    model_.load_state_dict(copy.deepcopy(model.state_dict()))
    lr = 1e-5
    optimizer, optimizer_ = torch.optim.Adam(model.parameters(), lr=lr), fused.optim.Adam(model_.parameters(), lr=lr)
    enabled = scaler_cls is not None
    scaler = torch.amp.GradScaler("cpu", enabled=enabled)
    scaler_ = (scaler_cls or torch.amp.GradScaler)("cpu", enabled=enabled)
    for _ in range(10):
        x, gt = torch.rand(8, 1, 14, 14).to(memory_format=torch.channels_last), torch.rand(8, 10)
        for m, opt, s in ((model, optimizer, scaler), (model_, optimizer_, scaler_)):
            with torch.autocast("cpu", dtype=torch.float16, enabled=enabled):
                loss = ((gt - m(x)) ** 2).mean()
            s.scale(loss).backward()
            s.step(opt)
            s.update()
        for m, m_ in zip(model.modules(), model_.modules()):
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                torch.testing.assert_close(m.weight, m_.weight, atol=1e-3, rtol=1e-3, equal_nan=True)
                torch.testing.assert_close(m.weight.grad, m_.weight.grad, atol=1e-3, rtol=1e-3, equal_nan=True)
        state, state_ = optimizer.state_dict(), optimizer_.state_dict()
        assert state["param_groups"] == state_["param_groups"]
        for i, s in state["state"].items():
            assert set(s) == set(state_["state"][i])
            for k, v in s.items():
                torch.testing.assert_close(state_["state"][i][k].reshape(v.shape), v, atol=1e-3, rtol=1e-3)
        optimizer.zero_grad()
        optimizer_.zero_grad()
        model_.load_state_dict(copy.deepcopy(model.state_dict()))
