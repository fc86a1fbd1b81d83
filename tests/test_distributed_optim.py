"""The fused optimizers and clip_grad_norm_ under DDP and FSDP2 (fully_shard, DTensor parameters) with 2 gloo
processes on CPU give the numbers of one process running torch's clip_grad_norm_ + torch.optim on the full batch."""

import datetime
import gc
import os
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import fused

WORLD = 2
STEPS = 3
MAX_NORM = 0.5


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 33), nn.Tanh(), nn.Linear(33, 24), nn.Tanh(), nn.Linear(24, 4))


def batch(step, rank):
    g = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def loss_fn(model, x, y):
    return ((model(x) - y) ** 2).mean()


def reference_run(opt_name, hyper):
    """One process, the whole batch: torch's clip_grad_norm_ + torch.optim."""
    model = make_model()
    opt = getattr(torch.optim, opt_name)(model.parameters(), foreach=False, **hyper)
    norms = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = sum(loss_fn(model, *batch(step, r)) for r in range(WORLD)) / WORLD
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
        opt.step()
    return [p.detach() for p in model.parameters()], norms


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def distribute(model, mode):
    if mode == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def run_worker(rank, body, init_file, *args):
    """Runs body(rank, *args) in a gloo group of WORLD processes and tears it down so that no gloo thread outlives
    the interpreter. A rank that exits while the other's work is in flight, or a DDP reducer that keeps the group
    alive into interpreter finalisation, aborts the process ("terminate called without an active exception", a
    flaky SIGABRT in CI; pytorch/pytorch#179291). So: barrier, drop every object that holds the group, destroy it,
    and leave with os._exit once the checks have passed, skipping finalisation."""
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD, timeout=datetime.timedelta(minutes=2)
    )
    torch.set_num_threads(1)
    body(rank, *args)  # an assertion error propagates to mp.spawn as a failure with its traceback
    dist.barrier()
    gc.collect()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def worker(rank, mode, opt_name, hyper):
    model = distribute(make_model(), mode)
    use_optimizer_clip = opt_name != "SGD"  # SGD runs fused.clip_grad_norm_ + fused.optim.SGD instead
    opt = getattr(fused.optim, opt_name)(
        model.parameters(), max_grad_norm=MAX_NORM if use_optimizer_clip else None, **hyper
    )
    norms = []
    for step in range(STEPS):
        opt.zero_grad()
        loss_fn(model, *batch(step, rank)).backward()
        if use_optimizer_clip:
            opt.step()
            norms.append(opt.last_grad_norm)
        else:
            norms.append(fused.clip_grad_norm_(model.parameters(), MAX_NORM))
            opt.step()
    expected_params, expected_norms = reference_run(opt_name, hyper)
    for got, want in zip(norms, expected_norms):
        torch.testing.assert_close(full(got), want, rtol=1e-5, atol=0)
    for p, want in zip(model.parameters(), expected_params):
        torch.testing.assert_close(full(p.detach()), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
@pytest.mark.parametrize(
    "opt_name,hyper",
    [("AdamW", dict(lr=1e-2, weight_decay=0.1)), ("SGD", dict(lr=0.1, momentum=0.9))],
    ids=["AdamW", "SGD"],
)
def test_same_numbers_as_one_process(mode, opt_name, hyper):
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(run_worker, args=(worker, os.path.join(tmp, "init"), mode, opt_name, hyper), nprocs=WORLD, join=True)


def master_worker(rank, mode):
    """A bf16 model with fp32 master weights (and fp32 accumulation of two micro-batches) under DDP / FSDP2: the
    masters equal those of one process stepping fused.optim.AdamW on the same (gathered) bf16 gradients."""
    model = make_model().to(torch.bfloat16)
    start = [p.detach().clone() for p in model.parameters()]
    model = distribute(model, mode)
    hyper = dict(lr=1e-2, weight_decay=0.1, max_grad_norm=MAX_NORM, master_weights=True)
    opt = fused.optim.AdamW(model.parameters(), **hyper)
    seen = []  # per step, per parameter: the full bf16 gradients of both micro-batches
    for step in range(STEPS):
        opt.zero_grad()
        micro = []
        for m in range(2):
            x, y = batch(step, rank)
            loss_fn(model, x[4 * m : 4 * m + 4].bfloat16(), y[4 * m : 4 * m + 4].bfloat16()).backward()
            micro.append([full(p.grad).clone() for p in model.parameters()])
            opt.accumulate_grads()
        seen.append(micro)
        opt.step()
    ref_params = [p.clone().requires_grad_() for p in start]
    ref = fused.optim.AdamW(ref_params, **hyper)
    for micro in seen:
        for grads in micro:
            for p, g in zip(ref_params, grads):
                p.grad = g
            ref.accumulate_grads()
        ref.step()
    for p, q in zip(model.parameters(), ref_params):
        torch.testing.assert_close(
            full(opt.state[p]["master_param"]), ref.state[q]["master_param"], rtol=1e-5, atol=1e-6
        )
        assert torch.equal(full(p.detach()), q.detach())


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_master_weights_distributed(mode):
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(run_worker, args=(master_worker, os.path.join(tmp, "init"), mode), nprocs=WORLD, join=True)


def int8_worker(rank, mode):
    """int8 Adam state under DDP / FSDP2: each rank quantizes its own shard (blocks never straddle shards; here the
    shards are whole blocks), and the parameters equal one process's stepping fused.optim.AdamW(state_dtype="int8")
    on the same full gradients under the same seeds. exp_avg_sq's codes round stochastically by each element's
    index in the tensor the kernel sees: under FSDP2 that is the shard, so the first shard (whose indices are the
    full tensor's) keeps the single process's bits, and the others draw other dithers, which move their parameters
    by a fraction of a step (measured after 3 steps: median 1e-3 lr, at most 0.08 lr)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 128), nn.Tanh(), nn.Linear(128, 64), nn.Tanh(), nn.Linear(64, 4))
    start = [p.detach().clone() for p in model.parameters()]
    model = distribute(model, mode)
    hyper = dict(lr=1e-2, weight_decay=0.1, max_grad_norm=MAX_NORM, state_dtype="int8")
    opt = fused.optim.AdamW(model.parameters(), **hyper)
    seen = []
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(step, rank)
        loss_fn(model, x, y).backward()
        seen.append([full(p.grad).clone() for p in model.parameters()])
        torch.manual_seed(100 + step)  # the stochastic rounding's seed, the same on every rank and in the reference
        opt.step()
    big = list(model.parameters())[2]  # 64 x 128: quantized, 4096 elements per FSDP2 shard
    codes = opt.state[big]["exp_avg"]
    local_codes = codes.to_local() if hasattr(codes, "to_local") else codes
    assert local_codes.dtype == torch.int8
    scales = fused.optim.quantize.local_scales(codes, opt.state[big]["exp_avg_scale"])
    assert scales.numel() == -(-local_codes.numel() // 256)
    ref_params = [p.clone().requires_grad_() for p in start]
    ref = fused.optim.AdamW(ref_params, **hyper)
    for step, grads in enumerate(seen):
        for p, g in zip(ref_params, grads):
            p.grad = g
        torch.manual_seed(100 + step)
        ref.step()
    for p, q in zip(model.parameters(), ref_params):
        ours, q = full(p.detach()), q.detach()
        first = ours.shape[0] if mode == "ddp" else -(-ours.shape[0] // WORLD)  # the rows of the first shard
        torch.testing.assert_close(ours[:first], q[:first], rtol=1e-5, atol=1e-6)
        if first < ours.shape[0]:
            diff = (ours[first:] - q[first:]).abs()
            assert diff.median() <= 1e-2 * hyper["lr"] and diff.max() <= 0.3 * hyper["lr"], (diff.median(), diff.max())


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_int8_state_distributed(mode):
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(run_worker, args=(int8_worker, os.path.join(tmp, "init"), mode), nprocs=WORLD, join=True)


def checkpoint_worker(rank, tmp):
    """torch.distributed.checkpoint of a FSDP2 model and fused.optim.AdamW (plain and int8 state): get_*_state_dict,
    dcp.save, dcp.load into a fresh model and optimizer, set_*_state_dict. Every rank's state comes back bit for bit
    (the int8 scales included: each rank's own) and both copies train on identically. The middle layer has 65 rows:
    uneven shards (33 and 32 rows), so the ranks hold different numbers of 8-bit blocks (17 and 16)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict as dsd

    def build(kw):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 128), nn.Tanh(), nn.Linear(128, 65), nn.Tanh(), nn.Linear(65, 4))
        model = distribute(model, "fsdp2")
        return model, fused.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, max_grad_norm=MAX_NORM, **kw)

    def train(model, opt, steps):
        losses = []
        for step in steps:
            opt.zero_grad()
            loss = loss_fn(model, *batch(step, rank))
            loss.backward()
            torch.manual_seed(100 + step)  # the seed of the int8 state's stochastic rounding
            opt.step()
            losses.append(loss.detach())
        return losses

    def local_state(opt, model):
        return [{k: full(v).clone() for k, v in opt.state[p].items()} for p in model.parameters()]

    for kw in ({}, {"state_dtype": "int8"}):
        model, opt = build(kw)
        train(model, opt, range(2))
        saved = local_state(opt, model)
        if not kw:
            plain_moments = [state["exp_avg"] for state in saved]
        else:  # dequantize_state gives the moments as DTensors, within the 8-bit error of the plain run's
            moments = fused.optim.dequantize_state(opt.state_dict())["state"]
            for i, want in enumerate(plain_moments):
                got = full(moments[i]["exp_avg"])
                assert got.dtype == torch.float32 and (got - want).abs().max() <= 0.05 * want.abs().max(), i
        path = os.path.join(tmp, f"ckpt{len(kw)}")
        dcp.save(
            {"model": dsd.get_model_state_dict(model), "optim": dsd.get_optimizer_state_dict(model, opt)},
            checkpoint_id=path,
        )
        want = train(model, opt, range(2, 4))

        model2, opt2 = build(kw)
        sd = {"model": dsd.get_model_state_dict(model2), "optim": dsd.get_optimizer_state_dict(model2, opt2)}
        dcp.load(sd, checkpoint_id=path)
        dsd.set_model_state_dict(model2, sd["model"])
        dsd.set_optimizer_state_dict(model2, opt2, sd["optim"])
        restored = local_state(opt2, model2)
        for before, after in zip(saved, restored):
            assert before.keys() == after.keys()
            for k in before:
                assert before[k].dtype == after[k].dtype and torch.equal(before[k], after[k]), (rank, kw, k)
        if kw:
            big = list(model2.parameters())[2]
            assert opt2.state[big]["exp_avg"].dtype == torch.int8
        got = train(model2, opt2, range(2, 4))
        assert all(torch.equal(a, b) for a, b in zip(got, want)), (rank, kw, got, want)
        for p, q in zip(model.parameters(), model2.parameters()):
            assert torch.equal(full(p.detach()), full(q.detach())), (rank, kw)


def test_distributed_checkpoint_fsdp2():
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(run_worker, args=(checkpoint_worker, os.path.join(tmp, "init"), tmp), nprocs=WORLD, join=True)


def zero_worker(rank):
    """fused.optim.AdamW as ZeroRedundancyOptimizer's optimizer_class under DDP (each rank steps its partition),
    clipped by torch's clip_grad_norm_ on the whole model, gives torch.optim.AdamW's numbers in the same setup
    (plain state); int8 state stays within a small fraction of a step of them."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    def run(cls, **kw):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 128), nn.Tanh(), nn.Linear(128, 64), nn.Tanh(), nn.Linear(64, 4))
        model = nn.parallel.DistributedDataParallel(model)
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=cls, lr=1e-2, weight_decay=0.1, **kw)
        for step in range(STEPS):
            opt.zero_grad()
            loss_fn(model, *batch(step, rank)).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            torch.manual_seed(100 + step)
            opt.step()
        return [p.detach() for p in model.parameters()], opt

    want, _ = run(torch.optim.AdamW)
    got, _ = run(fused.optim.AdamW)
    for p, q in zip(got, want):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    got, opt = run(fused.optim.AdamW, state_dtype="int8")
    local_params = [p for group in opt.optim.param_groups for p in group["params"]]
    assert all(opt.optim.state[p]["exp_avg"].dtype == torch.int8 for p in local_params if p.numel() >= 4096)
    for p, q in zip(got, want):
        assert (p - q).abs().max() <= 0.3 * 1e-2


def test_zero_redundancy_optimizer():
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(
            run_worker,
            args=(
                zero_worker,
                os.path.join(tmp, "init"),
            ),
            nprocs=WORLD,
            join=True,
        )
