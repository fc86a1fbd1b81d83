"""The CUDA kernels of the fused optimizers (run only where a GPU is present): the same numbers as the CPU
kernels, exactly two kernel launches per step, no host sync (CUDA graph capture), skip on inf, determinism."""

import math

import pytest
import torch
from harness import requires_cuda

import fused

pytestmark = requires_cuda

SHAPES = [(37, 5), (70001,), (3,), (2, 3, 131), (), (300_000,)]


def pair(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    cpu = [torch.randn(s, generator=g, dtype=torch.float64).to(dtype).requires_grad_() for s in SHAPES]
    gpu = [p.detach().cuda().requires_grad_() for p in cpu]
    return cpu, gpu


def set_grads(cpu, gpu, step, poison=False):
    g = torch.Generator().manual_seed(100 + step)
    for p, q in zip(cpu, gpu):
        p.grad = torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype)
        q.grad = p.grad.cuda()
    if poison:
        cpu[1].grad[5] = math.inf
        gpu[1].grad[5] = math.inf


@pytest.mark.parametrize(
    "name,hyper",
    [
        ("AdamW", dict(lr=1e-2, weight_decay=0.1)),
        ("Adam", dict(lr=1e-2, amsgrad=True, maximize=True)),
        ("SGD", dict(lr=0.1, momentum=0.9, dampening=0.2, weight_decay=0.01)),
        ("SGD", dict(lr=0.1, momentum=0.9, nesterov=True)),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_cuda_matches_cpu(name, hyper, dtype):
    cpu, gpu = pair(dtype)
    a = getattr(fused.optim, name)(cpu, max_grad_norm=1.0, clip_value=0.5, **hyper)
    b = getattr(fused.optim, name)(gpu, max_grad_norm=1.0, clip_value=0.5, **hyper)
    # float64: normed, clipped and updated in float64 on both (only the summation order differs)
    tol = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.float64: dict(rtol=1e-12, atol=1e-14)}.get(dtype, {})
    # 16-bit: the two differ where a last-bit difference of the fp32 update (the norm's summation order) crosses a
    # rounding boundary, and such a flip carries into later steps; each is judged against a float64 run instead.
    low = dtype in (torch.float16, torch.bfloat16)
    wide = [p.detach().double().requires_grad_() for p in cpu] if low else []
    c = getattr(fused.optim, name)(wide, max_grad_norm=1.0, clip_value=0.5, **hyper) if low else None
    for step in range(4):
        set_grads(cpu, gpu, step, poison=step == 2)
        for p, r in zip(cpu, wide):
            r.grad = p.grad.double()
        a.step()
        b.step()
        if low:
            c.step()
        assert b.last_grad_norm.dtype == a.last_grad_norm.dtype == dtype  # the gradients' dtype, as torch
        norm_tol = dict(tol, atol=0) if tol else {}
        torch.testing.assert_close(b.last_grad_norm.cpu(), a.last_grad_norm, equal_nan=True, **norm_tol)
        for p, q in zip(cpu, gpu):  # the clipped, unscaled gradient written back by both
            torch.testing.assert_close(q.grad.cpu(), p.grad, **tol)
    for i, (p, q) in enumerate(zip(cpu, gpu)):
        pairs = [(q.detach().cpu(), p.detach(), wide[i].detach() if low else None)]
        pairs += [(b.state[q][k].cpu(), v, c.state[wide[i]][k] if low else None) for k, v in a.state[p].items()]
        for ours, cpus, exact in pairs:
            if not low or not ours.is_floating_point():
                torch.testing.assert_close(ours, cpus, **tol)
            else:  # the GPU's error against float64 no worse than twice the CPU's
                gpu_err, cpu_err = (torch.linalg.vector_norm(t.double() - exact) for t in (ours, cpus))
                assert gpu_err <= 2 * cpu_err + 1e-30, (gpu_err, cpu_err)
    assert float(b.state[gpu[0]]["step"]) == 3.0


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf, 3.0])
def test_cuda_clip_grad_norm(norm_type):
    cpu, gpu = pair()
    set_grads(cpu, gpu, 0)
    n1 = torch.nn.utils.clip_grad_norm_(cpu, 1.0, norm_type)
    n2 = fused.clip_grad_norm_(gpu, 1.0, norm_type)
    torch.testing.assert_close(n2.cpu(), n1, rtol=1e-5, atol=0)
    for p, q in zip(cpu, gpu):
        torch.testing.assert_close(q.grad.cpu(), p.grad, rtol=1e-5, atol=1e-7)


def count_launches(fn):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def test_two_launches_per_step_whatever_the_number_of_tensors():
    params = [torch.randn(i + 1, 33, device="cuda", requires_grad=True) for i in range(3000)]
    params += [torch.randn(7, device="cuda", dtype=torch.bfloat16, requires_grad=True)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = fused.optim.AdamW(params, max_grad_norm=1.0)
    scaler = fused.amp.GradScaler("cuda")
    opt.step()  # state allocation and the one-time metadata copy
    assert count_launches(opt.step) == 2
    scaler.scale(torch.ones((), device="cuda"))  # creates the scale, as scaling the loss does
    scaler.step(opt)  # first use of the scaler
    scaler.update()
    assert count_launches(lambda: scaler.step(opt)) == 2


def test_cuda_graph_capture():
    """A captured step replays norm, update and the .grad write-back (the static gradients are refilled before each
    replay, as a captured backward would)."""
    params = [torch.randn(s, device="cuda", requires_grad=True) for s in [(1000, 3), (77,), (5, 5, 5)]]
    originals = [torch.randn_like(p) for p in params]
    static_grads = [g.clone() for g in originals]
    for p, g in zip(params, static_grads):
        p.grad = g
    opt = fused.optim.AdamW(params, lr=1e-2, max_grad_norm=0.5)
    ref_params = [p.detach().clone().requires_grad_() for p in params]
    ref = fused.optim.AdamW(ref_params, lr=1e-2, max_grad_norm=0.5)

    def ref_step():
        for q, g in zip(ref_params, originals):
            q.grad = g.clone()
        ref.step()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        opt.step()  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    ref_step()
    for step in range(3):
        torch._foreach_copy_(static_grads, originals)
        graph.replay()
        ref_step()
    torch.cuda.synchronize()
    for p, q, g in zip(params, ref_params, static_grads):
        torch.testing.assert_close(p, q)
        torch.testing.assert_close(g, q.grad)  # the clipped gradient, written back by the replay
    # warm-up + 3 replays (capture itself runs nothing) against 1 + 3 eager steps
    assert float(opt.state[params[0]]["step"]) == float(ref.state[ref_params[0]]["step"]) == 4.0


def test_cuda_deterministic():
    cpu, gpu = pair()
    set_grads(cpu, gpu, 0)
    norms = {fused.clip_grad_norm_(gpu, 1e9).item() for _ in range(5)}
    assert len(norms) == 1


def test_cuda_device_mismatch():
    a, b = torch.zeros(3, device="cuda", requires_grad=True), torch.zeros(3, requires_grad=True)
    a.grad, b.grad = torch.ones_like(a), torch.ones_like(b)
    with pytest.raises(RuntimeError, match="fused.optim.SGD: all parameters of one call must be on one device"):
        fused.optim.SGD([a, b], lr=0.1).step()


@pytest.mark.parametrize("name,hyper", [("AdamW", dict(lr=1e-2)), ("SGD", dict(lr=0.1, momentum=0.9))])
def test_cuda_master_weights_match_cpu(name, hyper):
    cpu, gpu = pair(torch.bfloat16)
    a = getattr(fused.optim, name)(cpu, master_weights=True, max_grad_norm=1.0, **hyper)
    b = getattr(fused.optim, name)(gpu, master_weights=True, max_grad_norm=1.0, **hyper)
    for step in range(3):
        set_grads(cpu, gpu, step)
        a.step()
        b.step()
    for p, q in zip(cpu, gpu):
        torch.testing.assert_close(b.state[q]["master_param"].cpu(), a.state[p]["master_param"], rtol=1e-5, atol=1e-6)
        assert torch.equal(q.detach(), b.state[q]["master_param"].bfloat16())


def test_cuda_stochastic_rounding_same_bits_as_cpu():
    cpu, gpu = pair(torch.bfloat16)
    a = fused.optim.AdamW(cpu, lr=1e-2, stochastic_rounding=True)
    b = fused.optim.AdamW(gpu, lr=1e-2, stochastic_rounding=True)
    for step in range(3):
        set_grads(cpu, gpu, step)
        torch.manual_seed(step)
        a.step()
        torch.manual_seed(step)
        b.step()
    for p, q in zip(cpu, gpu):
        # the same Philox bits; the fp32 update may differ in the last bit (fma), so compare within one bf16 ulp
        torch.testing.assert_close(q.detach().cpu().float(), p.detach().float(), rtol=2**-7, atol=1e-6)
        assert b.state[q]["exp_avg"].dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_master_weights_with_accumulation(dtype):
    cpu, gpu = pair(dtype)
    a = fused.optim.AdamW(cpu, lr=1e-2, master_weights=True, max_grad_norm=1.0)
    b = fused.optim.AdamW(gpu, lr=1e-2, master_weights=True, max_grad_norm=1.0)
    for step in range(3):
        for micro in range(4):
            set_grads(cpu, gpu, 10 * step + micro)
            a.accumulate_grads()
            b.accumulate_grads()
        a.step()
        b.step()
    for p, q in zip(cpu, gpu):
        torch.testing.assert_close(b.state[q]["master_param"].cpu(), a.state[p]["master_param"], rtol=1e-5, atol=1e-6)
        assert torch.equal(q.detach(), b.state[q]["master_param"].to(dtype))


@pytest.mark.parametrize(
    "name,groups",
    [
        ("AdamW", [dict(lr=1e-2, weight_decay=0.1), dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-6), dict(lr=1e-3)]),
        ("SGD", [dict(lr=0.1, momentum=0.9), dict(lr=0.03, momentum=0.5, dampening=0.1), dict(lr=0.2, momentum=0.1)]),
    ],
)
def test_param_groups_two_launches_and_cpu_numbers(name, groups):
    cpu, gpu = pair()

    def grouped(ps):
        return [dict(params=ps[:2], **groups[0]), dict(params=ps[2:4], **groups[1]), dict(params=ps[4:], **groups[2])]

    a = getattr(fused.optim, name)(grouped(cpu), lr=0.5, max_grad_norm=1.0)
    b = getattr(fused.optim, name)(grouped(gpu), lr=0.5, max_grad_norm=1.0)
    for step in range(3):
        set_grads(cpu, gpu, step)
        a.step()
        b.step()
    assert count_launches(b.step) == 2  # norm + one update for the three groups
    a.step()
    for p, q in zip(cpu, gpu):
        torch.testing.assert_close(q.detach().cpu(), p.detach(), rtol=1e-5, atol=1e-6)
