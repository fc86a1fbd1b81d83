"""Device time per kernel of the GPU cases that miss their targets, from torch.profiler: which launch of a fused call
takes the time (the grad-norm pass or the update of a clip+AdamW step; the GEMMs, the row kernel or the fp32
accumulation of linear_cross_entropy; the norm backward's rows or its weight-gradient sums), per backend.

    python3 tools/gpu_kernel_times.py     (tools/gpu_suite.sh runs it in its benchmark step: bench.log)
"""

import torch
from torch.profiler import ProfilerActivity, profile

import fused


def kernel_table(fn, label, steps=3):
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    totals = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            name = e.name[:90]
            count, us = totals.get(name, (0, 0.0))
            totals[name] = (count + 1, us + e.time_range.elapsed_us())
    print(f"\n{label}: device us per call, by kernel ({steps} calls)")
    for name, (count, us) in sorted(totals.items(), key=lambda kv: -kv[1][1])[:8]:
        print(f"  {us / steps:10.1f}  x{count // steps:<3} {name}")


def optimizer_cases(params_m=100):
    shapes = [(1024, 1024)] * params_m
    for dtype in (torch.float32, torch.bfloat16):
        params = [torch.randn(s, device="cuda", dtype=dtype, requires_grad=True) for s in shapes]
        for p in params:
            p.grad = torch.randn_like(p)
        for backend in ("cuda", "triton"):
            opt = fused.optim.AdamW(params, lr=1e-3, max_grad_norm=1.0)
            fused.set_backend(backend)
            kernel_table(opt.step, f"clip+AdamW {params_m}M params {dtype} fused[{backend}]")
        torch_opt = torch.optim.AdamW(params, lr=1e-3, fused=True)
        kernel_table(torch_opt.step, f"torch.optim.AdamW(fused=True) {params_m}M params {dtype} (no clipping)")
        del params, opt, torch_opt


def loss_case():
    x = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(131072, 1024, device="cuda") * 0.02).bfloat16().requires_grad_()
    t = torch.randint(0, 131072, (4096,), device="cuda")
    for backend in ("cuda", "triton"):
        fused.set_backend(backend)
        kernel_table(
            lambda: torch.autograd.grad(fused.linear_cross_entropy(x, w, t), (x, w)),
            f"linear_cross_entropy 4096x1024x131072 bf16 fwd+bwd fused[{backend}]",
        )


def norm_case():
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(8192, 1024, device="cuda", dtype=dtype, requires_grad=True)
        w = torch.ones(1024, device="cuda", dtype=dtype, requires_grad=True)
        g = torch.randn_like(x)
        for backend in ("cuda", "triton"):
            fused.set_backend(backend)
            kernel_table(
                lambda: torch.autograd.grad(fused.rms_norm(x, (1024,), w), (x, w), g),
                f"rms_norm 8192x1024 {dtype} fwd+bwd fused[{backend}]",
            )


if __name__ == "__main__":
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}")
    try:
        for case in (optimizer_cases, loss_case, norm_case):
            case()
            torch.cuda.empty_cache()
    finally:
        fused.set_backend("auto")
