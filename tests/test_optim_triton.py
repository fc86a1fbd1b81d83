"""The Triton kernels of the optimizer family's ops (fused/optim/triton_*.py): each launcher on TRITON_DEVICE's tensors
(the GPU where there is one, else CPU tensors under the interpreter) against the CPU op on CPU tensors, bit for bit
where the CPU kernel's math is elementwise (sgd_step_, scale_grads_, accumulate_grads_, adam_step_'s launches per
dtype group), grad_norm against float64 with a bound (its sum runs in another order); then the optimizers and
fused.clip_grad_norm_ under set_backend("triton") on a GPU against the CPU op (collected everywhere, skipped without
a GPU). adam_step_'s element math is held to the CPU op's bits by tests/test_optim_state8.py."""

import math

import pytest
import test_optim_cuda as cuda_tests  # its GPU checks, run below on Triton
import torch
from test_optim_state8 import assert_same  # the CPU op's bits, NaN counting as one NaN

import fused
from tests.harness import TRITON_DEVICE, backend, compile_for_sm90, requires_cuda, requires_triton

pytestmark = requires_triton

# a tensor over several programs with a partial last one, a small one, a 3-d one, an empty one
SHAPES = [(5000,), (37, 5), (2, 3, 11), (0,)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def randn(shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def all_same_bits(xs, ys):
    assert len(xs) == len(ys)
    for a, b in zip(xs, ys):
        assert_same(a.cpu(), b.cpu())


def dev(xs):
    """Copies of CPU tensors (None kept) on the device the Triton launchers run on."""
    return [None if x is None else x.to(TRITON_DEVICE, copy=True) for x in xs]


# ---------------------------------------------------------------- grad_norm


def mixed_grads(seed=0):
    """Gradients of every dtype, scaled by 4 (the loss scale below), one of them 16-bit only in a group."""
    return [randn(s, dt, seed + k, scale=4.0) for k, (s, dt) in enumerate(zip(SHAPES, DTYPES))]


def norm64(grads, inv, clip_value, norm_type):
    """The float64 norm of the unscaled, value-clipped gradients (inv a power of two: exact in every dtype)."""
    x = torch.cat([g.double().reshape(-1) * inv for g in grads]).clamp(-clip_value, clip_value)
    return torch.linalg.vector_norm(x, norm_type).item()


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf, 3.5])
def test_grad_norm_against_float64(norm_type):
    """The norm within float32's summation bound of the float64 norm (float64 gradients summed in float64), the
    coefficient from it, found_inf unset; finish=False: the float64 sum (max) before the root."""
    from fused.optim import triton_norm

    for grads, rtol in (
        (mixed_grads(), 1e-5),
        ([randn((3000,), torch.float64, 7), randn((5,), torch.float64, 8)], 1e-13),
    ):
        scale = torch.tensor(4.0)
        args = (grads, None, scale, norm_type, 1.0, 0.5)
        dev_args = (dev(grads), None, scale.to(TRITON_DEVICE), norm_type, 1.0, 0.5)
        norm, coef, found = triton_norm.grad_norm(*dev_args)
        cpu_norm, cpu_coef, cpu_found = torch.ops.fused.grad_norm(*args)
        ref = norm64(grads, 0.25, 0.5, norm_type)
        assert norm.dtype == cpu_norm.dtype == torch.float64 and coef.dtype == torch.float64
        assert abs(norm.item() - ref) <= rtol * ref, (norm.item(), ref)
        assert coef.item() == pytest.approx(min(1.0, 1.0 / (norm.item() + 1e-6)), rel=1e-15)
        assert abs(coef.item() - cpu_coef.item()) <= 2 * rtol * cpu_coef.item()
        assert_same(found.cpu(), cpu_found)
        acc, empty, found = triton_norm.grad_norm(*dev_args, finish=False)
        acc_ref = ref if norm_type in (1.0, math.inf) else ref**norm_type
        assert acc.dtype == torch.float64 and empty.shape == (0,) and found.item() == 0.0
        assert abs(acc.item() - acc_ref) <= norm_type * rtol * acc_ref


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_grad_norm_grid_stride(monkeypatch, norm_type):
    """Programs of the norm take every tile of their stride (pid, pid + programs, ...): with 1, 2, 3 and 100
    programs for 12 tiles of two tensors, the same norm as float64 within float32's bound, the max exactly, and an
    inf in a tile only the stride reaches is found."""
    from fused.optim import triton_lists, triton_norm

    grads = [randn((9 * 2048 + 5,), torch.float32, 3), randn((2 * 2048,), torch.float32, 4)]  # 10 + 2 tiles
    ref = norm64(grads, 1.0, math.inf, norm_type)
    for cap in (1, 2, 3, 100):
        monkeypatch.setattr(triton_lists, "STRIDE_PROGRAMS_INTERPRETED", cap)
        if TRITON_DEVICE != "cpu":
            monkeypatch.setattr(triton_lists, "STRIDE_PROGRAMS_PER_SM", cap)
            monkeypatch.setattr(triton_lists, "_sm_count", lambda index: 1)
        norm, _, found = triton_norm.grad_norm(dev(grads), None, None, norm_type, 1.0, math.inf)
        assert found.item() == 0.0
        if norm_type == math.inf:
            assert norm.item() == ref, cap
        else:
            assert abs(norm.item() - ref) <= 1e-5 * ref, (cap, norm.item(), ref)
        late = [g.clone() for g in grads]
        late[0][8 * 2048 + 3] = math.inf  # tile 8: program 8 % programs
        assert triton_norm.grad_norm(dev(late), None, None, norm_type, 1.0, math.inf)[2].item() == 1.0, cap


def test_grad_norm_16bit_dtype_no_clip_and_found_inf_in():
    """A norm over 16-bit gradients comes back in their dtype (the CPU op's value rounded once); max_norm = inf
    gives coefficient 1; a set found_inf argument is passed on; no gradients: norm 0."""
    from fused.optim import triton_norm

    grads = [randn((3000,), torch.bfloat16, 1), randn((7,), torch.bfloat16, 2)]
    found_in = torch.tensor(1.0)
    norm, coef, found = triton_norm.grad_norm(dev(grads), *dev([found_in]), None, 2.0, math.inf, math.inf)
    cpu = torch.ops.fused.grad_norm(grads, found_in, None, 2.0, math.inf, math.inf)
    assert norm.dtype == torch.bfloat16 and coef.item() == 1.0 and found.item() == 1.0
    torch.testing.assert_close(norm.cpu(), cpu[0], rtol=2**-7, atol=0)  # one bf16 ulp: another summation order
    norm, coef, found = triton_norm.grad_norm([], *dev([torch.tensor(0.0)]), None, 2.0, 1.0, math.inf)
    assert norm.dtype == torch.float32 and norm.item() == 0.0 and found.item() == 0.0
    assert coef.item() == min(1.0, 1.0 / 1e-6)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_grad_norm_nonfinite(bad, norm_type):
    """A NaN or inf gradient sets found_inf and propagates into the norm as in torch (inf -> coefficient 0, NaN ->
    NaN), value clipping or not."""
    from fused.optim import triton_norm

    for clip_value in (math.inf, 0.5):
        grads = mixed_grads()
        grads[0][4321] = bad
        norm, coef, found = triton_norm.grad_norm(dev(grads), None, None, norm_type, 1.0, clip_value)
        cpu_norm, cpu_coef, cpu_found = torch.ops.fused.grad_norm(grads, None, None, norm_type, 1.0, clip_value)
        assert found.item() == cpu_found.item() == 1.0
        if clip_value == 0.5 and bad == math.inf:  # clipped to 0.5: a finite norm, found_inf still set
            assert math.isfinite(norm.item()) and coef.item() == pytest.approx(cpu_coef.item(), rel=1e-5)
        else:
            assert_same(norm.cpu(), cpu_norm)
            assert_same(coef.cpu(), cpu_coef)


def test_grad_norm_checks():
    from fused.optim import triton_norm

    with pytest.raises(RuntimeError, match="fused.grad_norm: norm_type must be > 0"):
        triton_norm.grad_norm([torch.ones(3)], None, None, -1.0, 1.0, 1.0)
    with pytest.raises(RuntimeError, match="fused.grad_norm: max_norm must be >= 0"):
        triton_norm.grad_norm([torch.ones(3)], None, None, 2.0, -1.0, 1.0)


# ---------------------------------------------------------------- scale_grads_, accumulate_grads_


def test_scale_grads_same_bits_as_cpu():
    from fused.optim import triton_norm

    grads = mixed_grads()
    grads[1][3, 2] = math.nan
    ours, cpu = dev(grads), [g.clone() for g in grads]
    coef = torch.tensor(0.3, dtype=torch.float64)
    triton_norm.scale_grads_(ours, coef.to(TRITON_DEVICE))
    torch.ops.fused.scale_grads_(cpu, coef)
    all_same_bits(ours, cpu)
    assert not torch.equal(ours[0].cpu(), grads[0])


@pytest.mark.parametrize("overwrite", [False, True])
def test_accumulate_grads_same_bits_as_cpu(overwrite):
    """16-bit and float32 gradients into float32 sums, float64 into float64, one launch per dtype pair."""
    from fused.optim import triton_accumulate

    grads = mixed_grads(seed=3)
    accs = [randn(g.shape, torch.float64 if g.dtype == torch.float64 else torch.float32, 20 + k) for k, g in
            enumerate(grads)]  # fmt: skip
    ours, cpu = dev(accs), [a.clone() for a in accs]
    triton_accumulate.accumulate_grads_(ours, dev(grads), overwrite)
    torch.ops.fused.accumulate_grads_(cpu, grads, overwrite)
    all_same_bits(ours, cpu)


# ---------------------------------------------------------------- sgd_step_

SGD_MODES = ["float32", "bfloat16", "stochastic", "master", "float16", "float64"]


def sgd_lists(mode):
    """(params, model_params, buffer dtype) of a mode: bf16 params with float32 buffers, master weights (float32
    params and buffers, bf16 model params), or params and buffers in one dtype."""
    low = {"bfloat16": torch.bfloat16, "stochastic": torch.bfloat16, "master": torch.bfloat16}
    pdtype = {**low, "float16": torch.float16, "float64": torch.float64}.get(mode, torch.float32)
    model = [randn(s, pdtype, k) for k, s in enumerate(SHAPES)] if mode == "master" else []
    params = [m.float() for m in model] or [randn(s, pdtype, k) for k, s in enumerate(SHAPES)]
    buf = torch.float32 if pdtype == torch.bfloat16 else params[0].dtype
    for t in params + model:  # a zero param where step 0 has a zero gradient: the sign of d's zero is kept
        t.view(-1)[:1] = 0.0
    return params, model, buf


def run_sgd(step, mode, momentum, nesterov, hyper=None, device="cpu"):
    """Three sgd_step_ calls on device (loss scale 64, value clip 30, norm coefficient 0.5, write_grads): step 0
    with maximize, no weight decay and a zero gradient at a zero param (the sign of its zero kept), step 1 with a
    NaN gradient, step 2 skipped on found_inf. Returns every tensor the calls wrote, per call, on the CPU."""
    params, model, buf = sgd_lists(mode)
    bufs = [torch.zeros(p.shape, dtype=buf) for p in params]
    steps = [torch.zeros(()) for _ in params]
    seed = torch.tensor(-42) if mode == "stochastic" else None
    on = lambda xs: [None if x is None else x.to(device) for x in xs]  # noqa: E731
    params, model, bufs, steps, (seed, hyper) = on(params), on(model), on(bufs), on(steps), on([seed, hyper])
    gdtype = (model or params)[0].dtype
    out = []
    for n in range(3):
        grads = on([randn(p.shape, gdtype, 100 * n + k, scale=100.0) for k, p in enumerate(params)])
        grads[1].view(-1)[0] = 0.0
        if n == 1:
            grads[0][4097] = math.nan
        coef, scale, found = on(
            [torch.tensor(0.5, dtype=torch.float64), torch.tensor(64.0), torch.tensor(float(n == 2))]
        )
        step(
            params, grads, bufs if momentum else [], steps if momentum else [], 0.1, momentum,
            0.0 if nesterov else 0.25, 0.01 if n else 0.0, nesterov, n == 0, coef, scale, found, 30.0, model, seed,
            hyper, True,
        )  # fmt: skip
        out.append([t.cpu().clone() for t in params + grads + model + (bufs + steps if momentum else [])])
    return out


@pytest.mark.parametrize("momentum,nesterov", [(0.0, False), (0.9, False), (0.9, True)])
@pytest.mark.parametrize("mode", SGD_MODES)
def test_sgd_step_same_bits_as_cpu(mode, momentum, nesterov):
    """The CPU op's bits for params, momentum buffers, the gradients written back, the model params and the step
    counters, through a NaN gradient and a skipped step (nothing written, steps not counted)."""
    from fused.optim import triton_sgd

    ours = run_sgd(triton_sgd.sgd_step_, mode, momentum, nesterov, device=TRITON_DEVICE)
    cpu = run_sgd(torch.ops.fused.sgd_step_, mode, momentum, nesterov)
    for a, b in zip(ours, cpu):
        all_same_bits(a, b)
    # the skipped step left everything as the step before, but its fresh gradients (not written back)
    n = len(SHAPES)
    all_same_bits(ours[2][:n], ours[1][:n])
    all_same_bits(ours[2][2 * n :], ours[1][2 * n :])
    assert ours[1][0].isnan().any() and not ours[0][0].isnan().any()


def test_sgd_step_per_tensor_hyperparameters():
    """hyper rows (several param groups in one call): each tensor its own lr, momentum, dampening, weight decay."""
    from fused.optim import triton_sgd

    hyper = torch.tensor([[0.1, 0.9, 0.0, 0.0], [0.01, 0.5, 0.1, 0.1], [1.0, 0.99, 0.5, 0.0], [0.1, 0.9, 0.0, 0.0]],
                         dtype=torch.float64)  # fmt: skip
    ours = run_sgd(triton_sgd.sgd_step_, "float32", 0.9, False, hyper, TRITON_DEVICE)
    cpu = run_sgd(torch.ops.fused.sgd_step_, "float32", 0.9, False, hyper)
    for a, b in zip(ours, cpu):
        all_same_bits(a, b)


# ---------------------------------------------------------------- adam_step_: one launch per dtype group


def counting(monkeypatch, module, name):
    """Counts the launches of module.<name> (a Triton kernel) through its launcher."""
    kernel, launches = getattr(module, name), []

    class Counted:
        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]

    monkeypatch.setattr(module, name, Counted())
    return launches


def adam_call(device, dtypes, steps_at, found=0.0, hyper=None, state_dtype=None):
    """adam_step_'s arguments for params of `dtypes` (SHAPES' sizes, the last one empty) on device, with step
    counters at steps_at; the state in state_dtype (default: the params')."""
    params = [randn(s, dt, k).to(device) for k, (s, dt) in enumerate(zip(SHAPES, dtypes))]
    state = [[torch.zeros(p.shape, dtype=state_dtype or p.dtype, device=device) for p in params] for _ in range(2)]
    steps = [torch.full((), float(s), device=device) for s in steps_at]
    grads = [randn(p.shape, p.dtype, 50 + k).to(device) for k, p in enumerate(params)]
    coef, found = torch.tensor(0.5, dtype=torch.float64, device=device), torch.tensor(found, device=device)
    args = [params, grads, *state, [], steps, 1e-3, 0.9, 0.999, 1e-8, 0.01, False, True, False, coef, None, found]
    return args + [math.inf, [], None, None if hyper is None else hyper.to(device), True]


def test_adam_step_one_launch_per_dtype_group(monkeypatch):
    """Float32 and bfloat16 params (bf16 with float32 state), per-tensor hyperparameters, an empty tensor: two
    launches, the CPU op's bits."""
    from fused.optim import triton_kernels

    launches = counting(monkeypatch, triton_kernels, "_adam_kernel")
    dtypes = [torch.float32, torch.bfloat16, torch.float32, torch.bfloat16]
    hyper = torch.tensor([[1e-2, 0.9, 0.99, 1e-8, 0.1], [1e-3, 0.8, 0.999, 1e-6, 0.0]] * 2, dtype=torch.float64)
    ours = adam_call(TRITON_DEVICE, dtypes, [3] * 4, hyper=hyper, state_dtype=torch.float32)
    cpu = adam_call("cpu", dtypes, [3] * 4, hyper=hyper, state_dtype=torch.float32)
    triton_kernels.adam_step_(*ours)
    torch.ops.fused.adam_step_(*cpu)
    assert len(launches) == 2
    outputs = lambda args: args[0] + args[1] + args[2] + args[3] + args[5]  # noqa: E731 - params .. steps
    all_same_bits(outputs(ours), outputs(cpu))


def test_step_counters_advance_in_the_kernels_unless_skipped():
    """adam_step_ and sgd_step_ (momentum): the last program of each dtype group's launch advances that group's
    counters once (an empty tensor's too; a group of empty tensors alone takes a host op); with found_inf set none
    moves; the tickets are back at 0 after every launch."""
    from fused.optim import triton_kernels, triton_lists, triton_sgd

    dtypes = [torch.float32, torch.bfloat16, torch.float32, torch.float64]  # the float64 group: the empty tensor
    for found in (0.0, 1.0):
        args = adam_call(TRITON_DEVICE, dtypes, [0, 5, 7, 2], found)
        triton_kernels.adam_step_(*args)
        assert [s.item() for s in args[5]] == ([1, 6, 8, 3] if found == 0 else [0, 5, 7, 2])
        params, grads, bufs, _, _, steps = args[:6]
        triton_sgd.sgd_step_(
            params, grads, bufs, steps, 0.1, 0.9, 0.0, 0.0, False, False, args[14], None, args[16], math.inf, []
        )  # fmt: skip
        assert [s.item() for s in steps] == ([2, 7, 9, 4] if found == 0 else [0, 5, 7, 2])
        for t in triton_lists._tickets[params[0].device]:  # keyed by the tensors' device (cuda:0, not cuda)
            assert t.item() == 0


def test_adam_bias_corrections_in_the_kernel(monkeypatch):
    """The corrections as a GPU takes them, from each tensor's step counter in the kernel (pow in float64; under
    the interpreter not the C library's, so within rounding of the CPU op rather than its bits): per-tensor
    hyperparameters and step counts."""
    from fused.optim import triton_kernels

    monkeypatch.setattr(triton_kernels, "host_terms", lambda device: False)
    dtypes = [torch.float32, torch.bfloat16, torch.float32, torch.bfloat16]
    hyper = torch.tensor([[1e-2, 0.9, 0.99, 1e-8, 0.1], [1e-3, 0.8, 0.999, 1e-6, 0.0]] * 2, dtype=torch.float64)
    ours = adam_call(TRITON_DEVICE, dtypes, [0, 3, 1000, 1], hyper=hyper)
    cpu = adam_call("cpu", dtypes, [0, 3, 1000, 1], hyper=hyper)
    triton_kernels.adam_step_(*ours)
    torch.ops.fused.adam_step_(*cpu)
    for a, b in zip(cpu[0] + cpu[2] + cpu[3] + cpu[5], ours[0] + ours[2] + ours[3] + ours[5]):
        torch.testing.assert_close(b.cpu(), a, rtol=1e-6, atol=0)
    moved = [(p.cpu() != randn(s, p.dtype, k)).any() for k, (p, s) in enumerate(zip(ours[0][:3], SHAPES))]
    assert all(moved)


class LaunchingOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the torch ops that would run a kernel on the device (allocations, views and ops on no tensor run
    none)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        on_tensors = any(isinstance(a, torch.Tensor) for a in torch.utils._pytree.tree_leaves((args, kwargs)))
        if on_tensors and not (name.startswith("empty") or func.is_view):
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


def test_a_triton_step_is_its_launches(monkeypatch):
    """With the bias corrections in the kernel (as on a GPU), grad_norm, adam_step_ and sgd_step_ run no torch op
    of their own once their tables are cached: a clip+step on a GPU is one launch a dtype group for each pass
    (test_gpu_triton_clip_and_step_launches counts them on the device). The kernels are stubbed: what runs is the
    launchers' host code."""
    from fused.optim import triton_kernels, triton_norm, triton_sgd

    monkeypatch.setattr(triton_kernels, "host_terms", lambda device: False)
    launches = []

    class Stub:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append(self.name)

    for module, name in ((triton_norm, "_norm_kernel"), (triton_kernels, "_adam_kernel"), (triton_sgd, "_sgd_kernel")):
        monkeypatch.setattr(module, name, Stub(name))
    dtypes = [torch.float32, torch.bfloat16, torch.float32, torch.bfloat16]
    args = adam_call(TRITON_DEVICE, dtypes, [0, 3, 4, 1])
    params, grads, bufs, _, _, steps = args[:6]

    def step():
        norm, coef, found = triton_norm.grad_norm(grads, None, None, 2.0, 1.0, math.inf)
        triton_kernels.adam_step_(*args[:14], coef, None, found, *args[17:])
        triton_sgd.sgd_step_(params, grads, bufs, steps, 0.1, 0.9, 0.0, 0.0, False, False, coef, None, found,
                             math.inf, [])  # fmt: skip

    step()  # the tables and hyperparameters copied to the device
    launches.clear()
    with LaunchingOps() as recorded:
        step()
    assert recorded.ops == []
    assert launches == ["_norm_kernel"] * 2 + ["_adam_kernel"] * 2 + ["_sgd_kernel"] * 2


def test_every_optimizer_op_has_a_triton_kernel():
    """fused.info's table (from the GPU router's registrations) lists a Triton kernel for each op of the family,
    and each registered launcher is the function of that op's name."""
    from fused._backend import GPU_KERNELS, triton_launcher
    from fused.info import kernels

    for op in ("grad_norm", "scale_grads_", "sgd_step_", "adam_step_", "accumulate_grads_"):
        assert kernels(op)[2] == "Triton", op
        assert triton_launcher(GPU_KERNELS[op]["triton"]).__name__ == op


def test_lists_table_cached_and_grouped():
    """The launch tables: tensors grouped by their dtypes in order of appearance, empty ones left out, each tile of
    a tensor one program, and the same lists a second time the same (cached) table."""
    from fused.optim import triton_lists

    a, b, c, e = torch.zeros(5000), torch.zeros(10, dtype=torch.float16), torch.zeros(3), torch.zeros(0)
    grps = triton_lists.groups([[a, b, e, c]], 2048)
    assert [(g.dtypes, g.indices, g.programs) for g in grps] == [
        ((torch.float32,), [0, 3], 4),
        ((torch.float16,), [1], 1),
    ]
    table = grps[0].table
    assert table[0].tolist() == [a.data_ptr(), c.data_ptr()] and table[1:].tolist() == [[5000, 3], [0, 3], [0, 3]]
    assert grps[0].tensor_of.tolist() == [0, 0, 0, 1]
    assert triton_lists.groups([[a, b, e, c]], 2048)[0].table is table


def test_per_tensor_hyperparameters_cached_by_their_bits():
    """The per-tensor rows are copied to the device once for the same values (a captured step copies nothing), and
    again for other values, -0.0 against 0.0 included."""
    from fused.optim import triton_lists

    rows = [[1e-3, 0.9, 0.999, 1e-8, 0.0]] * 3
    first = triton_lists.per_tensor(rows, torch.device(TRITON_DEVICE))
    assert first.tolist() == rows and first.dtype == torch.float64
    assert triton_lists.per_tensor([list(r) for r in rows], torch.device(TRITON_DEVICE)) is first
    for other in ([[2e-3, 0.9, 0.999, 1e-8, 0.0]] * 3, [[1e-3, 0.9, 0.999, 1e-8, -0.0]] * 3, rows[:2]):
        again = triton_lists.per_tensor(other, torch.device(TRITON_DEVICE))
        assert again is not first and torch.equal(again.cpu(), torch.tensor(other, dtype=torch.float64))
        assert [math.copysign(1, x) for x in again[0].tolist()] == [math.copysign(1, x) for x in other[0]]


# ---------------------------------------------------------------- sm_90 compile


def test_optim_launchers_compile_for_sm90():
    """Every optimizer launcher builds for sm_90 (tests/triton_sm90.py, compile only): correctly rounded division
    and square roots only, and in sgd_step_ no fma but its own tl.fma (fp contraction off, as adam_step_)."""
    import re

    stdout = compile_for_sm90(["optim"])
    for kernel in (
        "_norm_kernel",
        "_finish_kernel",
        "_scale_grads_kernel",
        "_sgd_kernel",
        "_accumulate_kernel",
    ):
        assert f"compiled {kernel}:" in stdout, stdout
    sgd = re.search(
        r"compiled _sgd_kernel: (\d+) variants, sqrt.approx (\d+), fma.rn.f32 (\d+).*fma.rn.f64 (\d+)", stdout
    )
    assert sgd and int(sgd[2]) == 0, stdout
    assert (int(sgd[3]), int(sgd[4])) == SGD_SM90_FMAS, stdout


# tests/triton_sm90.py's sgd_step_ launches, 16 elements a thread (2048 a program, 4 warps) times the kernel's
# tl.fma: float32 without momentum (2: weight decay, update), with momentum (3), with nesterov (4), bf16 master
# weights with momentum (3), bf16 rounded stochastically (2); float64 with momentum (3)
SGD_SM90_FMAS = (16 * (2 + 3 + 4 + 3 + 2), 16 * 3)


# ---------------------------------------------------------------- GPU: the optimizers on Triton against the CPU op
# tests/test_optim_cuda.py's checks (clipping, value clipping, a skipped step, every dtype; clip_grad_norm_; master
# weights with accumulated micro-batches) with every optimizer op on Triton.


@requires_cuda
@pytest.mark.parametrize(
    "name,hyper",
    [
        ("AdamW", dict(lr=1e-2, weight_decay=0.1)),
        ("Adam", dict(lr=1e-2, amsgrad=True, maximize=True)),
        ("SGD", dict(lr=0.1, momentum=0.9, dampening=0.2, weight_decay=0.01)),
        ("SGD", dict(lr=0.1, momentum=0.9, nesterov=True, maximize=True)),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_gpu_optimizers_on_triton_match_cpu(name, hyper, dtype):
    with backend("triton"):
        cuda_tests.test_cuda_matches_cpu(name, hyper, dtype)


@requires_cuda
@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf, 3.0])
def test_gpu_clip_grad_norm_on_triton(norm_type):
    with backend("triton"):
        cuda_tests.test_cuda_clip_grad_norm(norm_type)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_master_weights_with_accumulation_on_triton(dtype):
    with backend("triton"):
        cuda_tests.test_cuda_master_weights_with_accumulation(dtype)


@requires_cuda
def test_gpu_triton_last_programs_under_load():
    """Thousands of programs a launch taking tickets at once, 100 clipped AdamW steps on Triton over 64 tensors and
    two gradient dtypes: every step's norm is the float64 norm of its gradients to float32 summation (a partial read
    before its program wrote it would miss), and every step counter ends at 100 (a lost or doubled ticket would
    miscount)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(1 + 37 * k, 129) for k in range(64)]
    params = [torch.zeros(s, device="cuda", dtype=torch.bfloat16 if k % 5 == 0 else torch.float32) for k, s in
              enumerate(shapes)]  # fmt: skip
    params = [p.requires_grad_() for p in params]
    with backend("triton"):
        opt = fused.optim.AdamW(params, lr=1e-3, max_grad_norm=1.0)
        for _ in range(100):
            for p in params:
                p.grad = torch.randn(p.shape, device="cuda", generator=gen).to(p.dtype)
            expected = torch.linalg.vector_norm(torch.cat([p.grad.double().flatten() for p in params]))
            opt.step()
            torch.testing.assert_close(opt.last_grad_norm.double(), expected, rtol=1e-5, atol=0)
    assert all(opt.state[p]["step"].item() == 100 for p in params)


@requires_cuda
def test_gpu_triton_clip_and_step_launches():
    """A clipped AdamW step and a scaler's step on Triton: one norm launch and one update launch a dtype group,
    whatever the number of tensors (tests/test_optim_cuda.py's count_launches: every kernel on the device)."""
    for dtypes, launches in (([torch.float32], 2), ([torch.float32, torch.bfloat16], 4)):
        params = [torch.randn(i + 1, 33, device="cuda", dtype=dtypes[i % len(dtypes)]) for i in range(300)]
        params = [p.requires_grad_() for p in params]
        for p in params:
            p.grad = torch.randn_like(p)
        with backend("triton"):
            opt = fused.optim.AdamW(params, max_grad_norm=1.0)
            scaler = fused.amp.GradScaler("cuda")
            opt.step()  # state allocation and the one-time table copies
            assert cuda_tests.count_launches(opt.step) == launches
            scaler.scale(torch.ones((), device="cuda"))
            scaler.step(opt)
            scaler.update()
            assert cuda_tests.count_launches(lambda: scaler.step(opt)) == launches


@requires_cuda
def test_gpu_triton_step_in_a_cuda_graph():
    """test_cuda_graph_capture on Triton: after a warm-up step (tables and hyperparameters copied to the device
    then), a captured clip+AdamW step replays as eager steps run."""
    with backend("triton"):
        cuda_tests.test_cuda_graph_capture()
