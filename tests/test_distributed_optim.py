"""The fused optimizers and clip_grad_norm_ under DDP and FSDP2 (fully_shard, DTensor parameters) with 2 gloo
processes on CPU give the numbers of one process running torch's clip_grad_norm_ + torch.optim on the full batch."""
import os
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


def worker(rank, init_file, mode, opt_name, hyper):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    try:
        model = make_model()
        if mode == "ddp":
            model = nn.parallel.DistributedDataParallel(model)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard
            mesh = init_device_mesh("cpu", (WORLD,))
            for layer in model:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
        use_optimizer_clip = opt_name != "SGD"  # SGD runs fused.clip_grad_norm_ + fused.optim.SGD instead
        opt = getattr(fused.optim, opt_name)(model.parameters(), max_grad_norm=MAX_NORM if use_optimizer_clip
                                             else None, **hyper)
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
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
@pytest.mark.parametrize("opt_name,hyper", [("AdamW", dict(lr=1e-2, weight_decay=0.1)),
                                            ("SGD", dict(lr=0.1, momentum=0.9))], ids=["AdamW", "SGD"])
def test_same_numbers_as_one_process(mode, opt_name, hyper):
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(os.path.join(tmp, "init"), mode, opt_name, hyper), nprocs=WORLD, join=True)
