"""fused.optim.SGD / Adam / AdamW against torch.optim (and the clip-and-step reference) over several steps."""

import copy
import inspect
import math

import pytest
import torch
from harness import assert_accuracy, raises

import fused
from fused.optim.reference import ReferenceOptimizer

SHAPES = [(37, 5), (70001,), (3,), (2, 3, 131), ()]  # odd sizes, one over a chunk (32768), a scalar

CONFIGS = [
    ("SGD", dict(lr=0.1)),
    ("SGD", dict(lr=0.1, momentum=0.9)),
    ("SGD", dict(lr=0.1, momentum=0.9, dampening=0.3, weight_decay=0.01)),
    ("SGD", dict(lr=0.1, momentum=0.8, nesterov=True, weight_decay=0.05, maximize=True)),
    ("Adam", dict(lr=1e-2)),
    ("Adam", dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1, maximize=True)),
    ("Adam", dict(lr=1e-2, weight_decay=0.1, amsgrad=True)),
    ("AdamW", dict(lr=1e-2)),
    ("AdamW", dict(lr=1e-2, weight_decay=0.3, amsgrad=True, maximize=True)),
]
IDS = [f"{n}-{'-'.join(f'{k}={v}' for k, v in kw.items())}" for n, kw in CONFIGS]


def make_params(dtype=torch.float32, seed=0, shapes=SHAPES):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g, dtype=torch.float64).to(dtype).requires_grad_() for s in shapes]


def clone(params):
    return [p.detach().clone().requires_grad_() for p in params]


def set_grads(groups, step, scale=1.0, dtype=None):
    g = torch.Generator().manual_seed(1000 + step)
    for ps in zip(*groups):
        grad = torch.randn(ps[0].shape, generator=g, dtype=torch.float64) * scale
        for p in ps:
            p.grad = grad.to(p.dtype, copy=True)  # one tensor per param: steps write .grad


def assert_params_close(a, b, rtol=2e-5, atol=2e-6):
    for x, y in zip(a, b):
        torch.testing.assert_close(x.detach(), y.detach().to(x.dtype), rtol=rtol, atol=atol)


@pytest.mark.parametrize("name,hyper", CONFIGS, ids=IDS)
def test_matches_torch_optim(name, hyper):
    ours, theirs = make_params(), make_params()
    opt = getattr(fused.optim, name)(ours, **hyper)
    ref = getattr(torch.optim, name)(theirs, foreach=False, **hyper)
    for step in range(5):
        set_grads([ours, theirs], step)
        opt.step()
        ref.step()
        assert_params_close(ours, theirs)
    for p, q in zip(ours, theirs):
        for key, value in ref.state[q].items():
            if key == "step":
                assert float(opt.state[p]["step"]) == float(value)
            elif value is not None:
                torch.testing.assert_close(opt.state[p][key], value, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("name", ["SGD", "Adam", "AdamW"])
def test_takes_torch_optimizer_arguments(name):
    """Drop-in: torch's implementation switches (foreach, fused, capturable) are taken and change nothing, and go
    into the param groups as torch's do; differentiable=True is refused by name; Adam's decoupled_weight_decay
    matches torch's."""
    hyper = dict(lr=0.1, momentum=0.9) if name == "SGD" else dict(lr=1e-2, weight_decay=0.1)
    switches = dict(foreach=True, fused=False) if name == "SGD" else dict(foreach=False, fused=True, capturable=True)
    plain, switched = make_params(), make_params()
    opts = [getattr(fused.optim, name)(plain, **hyper), getattr(fused.optim, name)(switched, **hyper, **switches)]
    for step in range(3):
        set_grads([plain, switched], step)
        for opt in opts:
            opt.step()
    for a, b in zip(plain, switched):
        assert torch.equal(a, b)
    assert all(opts[1].param_groups[0][k] == v for k, v in switches.items())
    with raises(f"fused.optim.{name}: differentiable"):
        getattr(fused.optim, name)(make_params(), **hyper, differentiable=True)
    if name == "Adam":
        ours, theirs = make_params(), make_params()
        opt = fused.optim.Adam(ours, decoupled_weight_decay=True, **hyper)
        ref = torch.optim.Adam(theirs, decoupled_weight_decay=True, foreach=False, **hyper)
        for step in range(4):
            set_grads([ours, theirs], step)
            opt.step()
            ref.step()
        assert_params_close(ours, theirs)


def test_adamw_signature_is_adams_with_its_own_weight_decay():
    """AdamW's parameters (what inspect shows and calls bind against) are Adam's but decoupled_weight_decay, with
    weight_decay=1e-2 by default, as torch.optim.AdamW's."""
    adam, adamw = inspect.signature(fused.optim.Adam), inspect.signature(fused.optim.AdamW)
    expected = [p for n, p in adam.parameters.items() if n != "decoupled_weight_decay"]
    expected = [p.replace(default=1e-2) if p.name == "weight_decay" else p for p in expected]
    assert list(adamw.parameters.values()) == expected
    opt = fused.optim.AdamW(make_params(), 1e-3, (0.8, 0.9), 1e-6)
    assert opt.defaults["weight_decay"] == 1e-2 and opt.defaults["decoupled_weight_decay"]
    with pytest.raises(TypeError, match="decoupled_weight_decay"):
        fused.optim.AdamW(make_params(), decoupled_weight_decay=False)


@pytest.mark.parametrize("name,hyper", CONFIGS[1:4:2] + CONFIGS[6:8], ids=IDS[1:4:2] + IDS[6:8])
@pytest.mark.parametrize("max_grad_norm,clip_value", [(1.0, None), (1e6, None), (2.0, 0.5), (None, 0.1)])
def test_clip_and_step_matches_reference(name, hyper, max_grad_norm, clip_value):
    ours, theirs = make_params(), make_params()
    opt = getattr(fused.optim, name)(ours, max_grad_norm=max_grad_norm, clip_value=clip_value, **hyper)
    ref = ReferenceOptimizer(name, theirs, max_grad_norm=max_grad_norm, clip_value=clip_value, **hyper)
    for step in range(4):
        set_grads([ours, theirs], step, scale=3.0)
        opt.step()
        ref.step()
        assert opt.last_grad_norm.dtype == torch.float32 and opt.last_grad_norm.dim() == 0
        torch.testing.assert_close(opt.last_grad_norm, ref.last_grad_norm.float(), rtol=1e-5, atol=0)
        assert_params_close(ours, theirs)


@pytest.mark.parametrize("name,hyper", [CONFIGS[3], CONFIGS[5], CONFIGS[8]], ids=[IDS[3], IDS[5], IDS[8]])
@pytest.mark.parametrize(
    "max_grad_norm,clip_value", [(None, None), (0.1, None), (None, 0.01), (0.1, 0.01), (1e9, None)]
)
def test_grad_after_step_is_what_the_torch_recipe_leaves(name, hyper, max_grad_norm, clip_value):
    """.grad after step() holds the gradient the update used, as torch's clip_grad_value_ + clip_grad_norm_ + step
    leaves it: value-clipped, then norm-clipped; maximize and weight decay never touch it. Where nothing clips, .grad
    is not written at all (bit for bit what backward left)."""
    ours, theirs = make_params(), make_params()
    opt = getattr(fused.optim, name)(ours, max_grad_norm=max_grad_norm, clip_value=clip_value, **hyper)
    ref = ReferenceOptimizer(name, theirs, max_grad_norm=max_grad_norm, clip_value=clip_value, **hyper)
    for step in range(2):
        set_grads([ours, theirs], step, scale=3.0)
        before = [p.grad.clone() for p in ours]
        opt.step()
        ref.step()
        for p, q, b in zip(ours, theirs, before):
            if max_grad_norm in (None, 1e9) and clip_value is None:
                assert torch.equal(p.grad, b)
            else:
                assert not torch.equal(p.grad, b) or p.numel() == 1
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_grad_write_back_in_the_gradient_dtype(dtype):
    """16-bit gradients receive the clipped gradient rounded once to their dtype (the update itself uses it in
    fp32); float64 ones are clipped in float64. Each is as close to float64 clipping as torch's clip_grad_norm_
    in that dtype."""
    ours, theirs = make_params(dtype), make_params(dtype)
    exact = make_params(torch.float64)
    opt = fused.optim.AdamW(ours, lr=1e-3, max_grad_norm=0.5)
    set_grads([ours, theirs, exact], 0, scale=3.0)
    opt.step()
    torch.nn.utils.clip_grad_norm_(theirs, 0.5)
    torch.nn.utils.clip_grad_norm_(exact, 0.5)
    for p, q, e in zip(ours, theirs, exact):
        assert p.grad.dtype == dtype
        assert_accuracy(p.grad, q.grad, e.grad)


def strided_grads(shape, seed):
    """Gradients of the same values in the layouts torch's unscale test uses: dense, transposed (dense, other
    order), and strided views with gaps ([:, :5] of a wider tensor)."""
    g = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).float() * 3
    wide = torch.zeros(shape[0], shape[1] * 3)
    wide[:, 1 : 1 + shape[1]] = g
    return [g.clone(), g.t().contiguous().t(), wide[:, 1 : 1 + shape[1]]]


@pytest.mark.parametrize("name,hyper", [CONFIGS[2], CONFIGS[6], CONFIGS[7]], ids=[IDS[2], IDS[6], IDS[7]])
@pytest.mark.parametrize("scaled", [False, True])
def test_strided_grads(name, hyper, scaled):
    """Non-dense (strided) and transposed .grad are taken and give torch's result; .grad keeps its own layout and
    holds the unscaled clipped gradient afterwards, as the torch recipe leaves it."""
    shape = (20, 5)
    ours = [torch.zeros(shape, requires_grad=True) for _ in range(3)]
    theirs = clone(ours)
    opt = getattr(fused.optim, name)(ours, max_grad_norm=1.0, **hyper)
    ref = getattr(torch.optim, name)(theirs, foreach=False, **hyper)
    scaler = fused.amp.GradScaler("cpu", init_scale=2.0**7, enabled=scaled)
    scaler.scale(torch.ones(()))
    for step in range(3):
        for p, q, g in zip(ours, theirs, strided_grads(shape, step)):
            q.grad = g.clone()
            p.grad = g.mul_(scaler.get_scale())  # in place: the layout stays
        strides = [p.grad.stride() for p in ours]
        scaler.step(opt)
        scaler.update()
        torch.nn.utils.clip_grad_norm_(theirs, 1.0)
        ref.step()
        assert [p.grad.stride() for p in ours] == strides and strides[2] == (15, 1)
        assert_params_close(ours, theirs)
        for p, q in zip(ours, theirs):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", ["SGD", "Adam", "AdamW"])
def test_expanded_grads_as_torch(name):
    """A gradient that overlaps itself (expanded) is read as torch reads it when the step writes nothing back; where
    it would write (a scale, clipping), it is refused before anything changes, as torch's in-place ops refuse it."""
    base = torch.randn(5, generator=torch.Generator().manual_seed(0))
    ours, theirs = [torch.zeros(4, 5, requires_grad=True)], [torch.zeros(4, 5, requires_grad=True)]
    ours[0].grad, theirs[0].grad = base.expand(4, 5), base.expand(4, 5)
    extra = dict(momentum=0.9) if name == "SGD" else {}
    getattr(fused.optim, name)(ours, lr=0.1, **extra).step()
    getattr(torch.optim, name)(theirs, lr=0.1, foreach=False, **extra).step()
    assert_params_close(ours, theirs)
    opt = getattr(fused.optim, name)(ours, lr=0.1, max_grad_norm=1.0, **extra)
    before = ours[0].detach().clone()
    with raises(f"fused.optim.{name}: a gradient of shape \\(4, 5\\) overlaps itself in memory"):
        opt.step()
    assert torch.equal(ours[0].detach(), before) and not opt.state[ours[0]]
    with pytest.raises(RuntimeError, match="more than one element of the written-to tensor"):
        torch.nn.utils.clip_grad_norm_(theirs, 1.0)  # torch's recipe fails there too


def test_param_groups_scheduler_zero_grad_closure():
    ours, theirs = make_params(), make_params()

    def groups(ps):
        return [{"params": ps[:2], "lr": 0.05}, {"params": ps[2:], "weight_decay": 0.2}]

    opt, ref = fused.optim.AdamW(groups(ours), lr=0.01), torch.optim.AdamW(groups(theirs), lr=0.01, foreach=False)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref, step_size=2, gamma=0.5)
    for step in range(5):

        def closure(ps=ours):
            opt.zero_grad()
            loss = sum((p.double() ** 2).sum() * (i + 1) for i, p in enumerate(ps))
            loss.backward()
            return loss

        def ref_closure(ps=theirs):
            ref.zero_grad()
            loss = sum((p.double() ** 2).sum() * (i + 1) for i, p in enumerate(ps))
            loss.backward()
            return loss

        torch.testing.assert_close(opt.step(closure), ref.step(ref_closure))
        sched.step()
        ref_sched.step()
        assert_params_close(ours, theirs)
    opt.zero_grad()
    assert all(p.grad is None for p in ours)
    assert opt.param_groups[0]["lr"] == ref.param_groups[0]["lr"] == 0.05 * 0.25


@pytest.mark.parametrize("name,hyper", [CONFIGS[2], CONFIGS[6], CONFIGS[8]], ids=[IDS[2], IDS[6], IDS[8]])
@pytest.mark.parametrize("direction", ["torch_to_fused", "fused_to_torch"])
def test_state_dict_interop(name, hyper, direction):
    a, b = make_params(), make_params()
    first = (
        getattr(torch.optim, name)(a, foreach=False, **hyper)
        if direction == "torch_to_fused"
        else getattr(fused.optim, name)(a, **hyper)
    )
    for step in range(3):
        set_grads([a], step)
        first.step()
    with torch.no_grad():
        for p, q in zip(a, b):
            q.copy_(p)
    second = (
        getattr(fused.optim, name)(b, **hyper)
        if direction == "torch_to_fused"
        else getattr(torch.optim, name)(b, foreach=False, **hyper)
    )
    second.load_state_dict(copy.deepcopy(first.state_dict()))  # as if through torch.save / torch.load
    for step in range(3, 6):
        set_grads([a, b], step)
        first.step()
        second.step()
        assert_params_close(a, b)
    assert set(first.state_dict()["state"][0]) <= set(second.state_dict()["state"][0]) | {"step"}


@pytest.mark.parametrize("name,hyper", [CONFIGS[3], CONFIGS[6], CONFIGS[7]], ids=[IDS[3], IDS[6], IDS[7]])
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_skipped_step_changes_nothing(name, hyper, bad):
    params = make_params()
    opt = getattr(fused.optim, name)(params, max_grad_norm=1.0, **hyper)
    set_grads([params], 0)
    opt.step()
    before = [p.detach().clone() for p in params]
    state_before = {i: {k: v.clone() for k, v in opt.state[p].items()} for i, p in enumerate(params)}
    set_grads([params], 1)
    params[1].grad[12345] = bad
    opt.step()
    assert not math.isfinite(opt.last_grad_norm.item())
    for i, (p, q) in enumerate(zip(params, before)):
        assert torch.equal(p.detach(), q)
        for k, v in opt.state[p].items():
            assert torch.equal(v, state_before[i][k]), k
    # the next finite step goes on from where the skipped one left off
    set_grads([params], 2)
    opt.step()
    assert float(opt.state[params[0]]["step"]) == 2.0 and math.isfinite(opt.last_grad_norm.item())


def test_fp32_and_16bit_in_one_group():
    """Mixed dtypes in one group; 16-bit math runs in fp32, so our error vs a float64 run is no worse than torch's."""
    shapes = [(33, 7), (1000,), (5, 40)]
    dtypes = [torch.float32, torch.bfloat16, torch.float16]
    base = make_params(torch.float64, shapes=shapes)
    ours = [p.detach().to(d).requires_grad_() for p, d in zip(base, dtypes)]
    theirs = clone(ours)
    exact = clone(base)
    hyper = dict(lr=1e-2, eps=1e-3, max_grad_norm=1.0)  # eps=1e-8 underflows in torch's fp16 math (NaN)
    opt = fused.optim.AdamW(ours, **hyper)
    ref = ReferenceOptimizer("AdamW", theirs, **hyper)
    ref64 = ReferenceOptimizer("AdamW", exact, **hyper)
    for step in range(4):
        set_grads([ours, theirs, exact], step)
        opt.step()
        ref.step()
        ref64.step()
    for o, t, e in zip(ours, theirs, exact):
        assert o.dtype == t.dtype
        ours_err = (o.detach().double() - e.detach()).norm()
        torch_err = (t.detach().double() - e.detach()).norm()
        assert ours_err <= 2 * torch_err + 1e-6 * e.norm(), (o.dtype, ours_err, torch_err)


@pytest.mark.parametrize("name,hyper", [CONFIGS[2], CONFIGS[6], CONFIGS[8]], ids=[IDS[2], IDS[6], IDS[8]])
def test_float64_params(name, hyper):
    """float64 gradients are normed and clipped in float64 (last_grad_norm is float64, as torch's norm) and the
    update runs in float64: parameters, state and norm agree with torch's float64 recipe to float64 precision."""
    ours, theirs = make_params(torch.float64), make_params(torch.float64)
    opt = getattr(fused.optim, name)(ours, max_grad_norm=1.0, clip_value=0.5, **hyper)
    ref = ReferenceOptimizer(name, theirs, max_grad_norm=1.0, clip_value=0.5, **hyper)
    for step in range(3):
        set_grads([ours, theirs], step, scale=3.0)
        opt.step()
        ref.step()
        assert opt.last_grad_norm.dtype == torch.float64
        torch.testing.assert_close(opt.last_grad_norm, ref.last_grad_norm, rtol=1e-13, atol=0)
        assert_params_close(ours, theirs, rtol=1e-12, atol=1e-14)
        for p, q in zip(ours, theirs):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-13, atol=1e-15)


def test_deterministic_across_thread_counts():
    threads = torch.get_num_threads()
    norms = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            params = make_params(shapes=[(300_001,), (70_000,), (17,)])
            set_grads([params], 0, scale=1e3)
            opt = fused.optim.SGD(params, lr=0.1, max_grad_norm=1.0)
            opt.step()
            norms.append((opt.last_grad_norm.clone(), [p.detach().clone() for p in params]))
    finally:
        torch.set_num_threads(threads)
    for norm, ps in norms[1:]:
        assert torch.equal(norm, norms[0][0])
        assert all(torch.equal(p, q) for p, q in zip(ps, norms[0][1]))


def test_params_without_grad_are_untouched():
    params = make_params()
    opt = fused.optim.AdamW(params, lr=0.1)
    set_grads([params], 0)
    params[0].grad = None
    before = params[0].detach().clone()
    opt.step()
    assert torch.equal(params[0].detach(), before) and params[0] not in opt.state


@pytest.mark.parametrize(
    "cls,arg",
    [
        (c, a)
        for c in ("SGD", "Adam", "AdamW")
        for a in ("lr", "max_grad_norm", "clip_value", "weight_decay") + (("momentum",) if c == "SGD" else ("eps",))
    ],
)
def test_negative_arguments(cls, arg):
    kwargs = {"lr": 0.1, arg: -1.0}
    with raises(f"fused.optim.{cls}: {arg} must be >= 0"):
        getattr(fused.optim, cls)(make_params(), **kwargs)


def test_bad_inputs():
    with raises("fused.optim.Adam: betas\\[1\\] must be in"):
        fused.optim.Adam(make_params(), betas=(0.9, 1.0))
    with raises("fused.optim.SGD: nesterov needs momentum"):
        fused.optim.SGD(make_params(), lr=0.1, nesterov=True)
    p = torch.zeros(10, requires_grad=True)
    p.grad = torch.sparse_coo_tensor([[1, 3]], [1.0, 2.0], (10,))
    with raises("fused.optim.AdamW: sparse gradients are not supported"):
        fused.optim.AdamW([p]).step()
    a, b = torch.zeros(3, requires_grad=True), torch.zeros(3, device="meta", requires_grad=True)
    a.grad, b.grad = torch.ones(3), torch.ones(3, device="meta")
    with raises("fused.optim.SGD: all parameters of one call must be on one device, got cpu, meta"):
        fused.optim.SGD([a, b], lr=0.1).step()


def test_ops_reject_bad_arguments():
    p, g = torch.zeros(4), torch.ones(4)
    coef, found = torch.ones((), dtype=torch.float64), torch.zeros(())
    with raises("fused.adam_step_: lr must be >= 0"):
        torch.ops.fused.adam_step_(
            [p],
            [g],
            [p.clone()],
            [p.clone()],
            [],
            [torch.zeros(())],
            -1.0,
            0.9,
            0.99,
            1e-8,
            0.0,
            False,
            False,
            False,
            coef,
            None,
            found,
            math.inf,
            [],
        )
    with raises(r"fused.sgd_step_: grads\[0\] has dtype Double but params\[0\] has Float"):
        torch.ops.fused.sgd_step_(
            [p], [g.double()], [], [], 0.1, 0.0, 0.0, 0.0, False, False, coef, None, found, math.inf, []
        )
    with raises("fused.grad_norm: norm_type must be > 0"):
        torch.ops.fused.grad_norm([g], found, None, -1.0, math.inf, math.inf, True)
    with raises(
        r"fused.grad_norm: grads must be dense in memory \(no gaps, no overlap\), got sizes \[4, 2\] and "
        r"strides \[4, 1\]"
    ):
        torch.ops.fused.grad_norm([torch.ones(4, 4)[:, :2]], found, None, 2.0, math.inf, math.inf, True)


@pytest.mark.parametrize("name", ["SGD", "Adam", "AdamW"])
def test_two_fused_ops_per_step_whatever_the_number_of_tensors(name):
    """The CPU step is the same two passes as the GPU's two launches: the norm (with the finite check) and one
    update for every tensor of every group, with or without a scaler; clip_grad_norm_ is the norm and one scale."""
    from torch.profiler import ProfilerActivity, profile

    def fused_ops(fn):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
        return [e.name for e in prof.events() if e.name.startswith("fused::")]

    params = make_params(shapes=[(10, 3), (7,), (5, 5)] * 40)
    set_grads([params], 0)
    extra = dict(momentum=0.9) if name == "SGD" else {}
    opt = getattr(fused.optim, name)(
        [{"params": params[:50]}, {"params": params[50:], "lr": 1e-2}], lr=0.1, max_grad_norm=1.0, **extra
    )
    opt.step()  # state allocation
    step_op = "fused::sgd_step_" if name == "SGD" else "fused::adam_step_"
    assert fused_ops(opt.step) == ["fused::grad_norm", step_op]
    scaler = fused.amp.GradScaler("cpu")
    scaler.scale(torch.ones(()))
    assert fused_ops(lambda: scaler.step(opt)) == ["fused::grad_norm", step_op]
    assert fused_ops(lambda: fused.clip_grad_norm_(params, 1.0)) == ["fused::grad_norm", "fused::scale_grads_"]


@pytest.mark.parametrize("options,passes", [({}, 1), ({"track_grad_norm": True}, 2), ({"max_grad_norm": 1.0}, 2)])
def test_plain_step_is_one_pass_and_the_norm_is_there_when_asked(monkeypatch, options, passes):
    """No clipping, no scaler, no track_grad_norm: the update alone (no grad_norm), as torch's step, with
    last_grad_norm None; asked for or clipping, the norm pass runs and last_grad_norm holds the norm."""
    import fused.optim.optimizer as optimizer

    calls = []
    real = optimizer.global_norm
    monkeypatch.setattr(optimizer, "global_norm", lambda *a, **k: calls.append(1) or real(*a, **k))
    params = make_params()
    theirs = clone(params)
    opt = fused.optim.AdamW(params, lr=1e-2, **options)
    ref = torch.optim.AdamW(theirs, lr=1e-2)
    for step in range(3):
        set_grads([params, theirs], step)
        if "max_grad_norm" in options:
            torch.nn.utils.clip_grad_norm_(theirs, options["max_grad_norm"])
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
        opt.step()
        ref.step()
        assert_params_close(params, theirs)
        if passes == 1:
            assert opt.last_grad_norm is None
        else:
            torch.testing.assert_close(opt.last_grad_norm, norm, rtol=1e-5, atol=0)
    assert len(calls) == (passes - 1) * 3
    # one pass has no finite check: a NaN gradient reaches its parameter, as in torch
    if passes == 1:
        set_grads([params], 3)
        params[0].grad.view(-1)[5] = math.nan
        opt.step()
        assert params[0].detach().view(-1)[5].isnan() and params[0].detach().view(-1)[6].isfinite()


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
@pytest.mark.parametrize(
    "name, hyper",
    [("SGD", dict(lr=0.1)), ("AdamW", dict(lr=1e-2, max_grad_norm=0.5, clip_value=2.0, state_dtype="int8"))],
)
def test_copied_optimizer_steps_as_the_original(name, hyper, how):
    """torch.optim.Optimizer pickles only defaults, state and param_groups: the fused options (clipping, state
    dtype, accumulation buffers) ride along, so a deepcopy or torch.save of the optimizer (with its params) steps
    to the same bits as the original (under the same seed: int8 state rounds exp_avg_sq stochastically)."""
    import io

    params = make_params(shapes=[(70, 80), (5,)])
    opt = getattr(fused.optim, name)(params, **hyper)
    set_grads([params], 0)
    opt.step()
    if how == "deepcopy":
        params2, opt2 = copy.deepcopy((params, opt))
    else:
        buffer = io.BytesIO()
        torch.save((params, opt), buffer)
        buffer.seek(0)
        params2, opt2 = torch.load(buffer, weights_only=False)
    assert (opt2.max_grad_norm, opt2.clip_value) == (opt.max_grad_norm, opt.clip_value)
    for step in (1, 2):
        set_grads([params, params2], step, scale=10.0)
        for o in (opt, opt2):
            torch.manual_seed(step)
            o.step()
    for p, q in zip(params, params2):
        assert torch.equal(p, q)


@pytest.mark.parametrize("name", ["SGD", "Adam", "AdamW"])
def test_state_dict_of_an_older_torch_loads_and_steps(name):
    """Group keys added in later torch versions (maximize, foreach, amsgrad, nesterov, differentiable, fused,
    capturable, decoupled_weight_decay) missing from a saved state dict get their defaults on load, as torch's
    optimizers' __setstate__ gives them; an Adam state dict loaded into AdamW decays decoupled, as torch.optim.AdamW."""
    params, theirs = make_params(shapes=[(7, 3)]), make_params(shapes=[(7, 3)])
    torch_cls = getattr(torch.optim, name)
    ref = torch_cls(theirs, lr=1e-2, weight_decay=0.1)
    ours = getattr(fused.optim, name)(params, lr=1e-2, weight_decay=0.1)
    set_grads([theirs], 0)
    ref.step()
    state = copy.deepcopy(ref.state_dict())  # loading may keep the tensors it is given
    for group in state["param_groups"]:
        for key in ("maximize", "foreach", "amsgrad", "nesterov", "differentiable", "fused", "capturable"):
            group.pop(key, None)
    if name == "AdamW":
        state["param_groups"][0]["decoupled_weight_decay"] = False  # an Adam state dict
    ours.load_state_dict(state)
    with torch.no_grad():
        for p, q in zip(params, theirs):
            p.copy_(q)
    assert all(ours.param_groups[0][key] == value for key, value in ours.defaults.items() if key != "params")
    for step in (1, 2):
        set_grads([params, theirs], step)
        ours.step()
        ref.step()
    assert_params_close(params, theirs)


def test_complex_parameters_are_refused_naming_the_optimizer():
    p = torch.zeros(3, dtype=torch.complex64, requires_grad=True)
    for cls in (fused.optim.SGD, fused.optim.Adam, fused.optim.AdamW):
        with raises(f"fused.optim.{cls.__name__}: params: complex parameters"):
            cls([p], lr=0.1)
        opt = cls([torch.zeros(3, requires_grad=True)], lr=0.1)
        with raises(f"fused.optim.{cls.__name__}: params: complex parameters"):
            opt.add_param_group({"params": [p]})


@pytest.mark.parametrize("hyper", [dict(), dict(state_dtype="int8"), dict(master_weights=True)], ids=str)
def test_load_state_dict_hooks_see_and_shape_what_is_loaded(hyper):
    """A load_state_dict pre-hook's returned dict is what loads (fp32 masters and 8-bit codes included), and a
    post-hook sees the state in its final form (the codes, not float moments), as torch's hooks do."""
    dtype = torch.bfloat16 if hyper.get("master_weights") else torch.float32
    params = make_params(dtype, shapes=[(64, 80)])
    opt = fused.optim.AdamW(params, lr=1e-2, **hyper)
    set_grads([params], 0)
    opt.step()
    saved = copy.deepcopy(opt.state_dict())

    def zero_state(optimizer, state_dict):
        state_dict = copy.deepcopy(state_dict)
        for state in state_dict["state"].values():
            for key, value in state.items():
                if key != "step":
                    state[key] = torch.zeros_like(value)
        return state_dict

    seen = {}
    other = fused.optim.AdamW(make_params(dtype, shapes=[(64, 80)]), lr=1e-2, **hyper)
    other.register_load_state_dict_pre_hook(zero_state)
    other.register_load_state_dict_post_hook(
        lambda o: seen.update({k: v.dtype for k, v in o.state[o.param_groups[0]["params"][0]].items()})
    )
    other.load_state_dict(saved)
    state = other.state[other.param_groups[0]["params"][0]]
    assert seen == {key: value.dtype for key, value in state.items()}
    assert seen == {key: value.dtype for key, value in opt.state[params[0]].items()}
    assert all(not value.any() for key, value in state.items() if key != "step")
