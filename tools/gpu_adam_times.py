"""Time of one fused AdamW step without clipping (one launch) at 402.9M float32 parameters in 224 tensors, with
fp32, bf16 and int8 state on each GPU backend: graph ms (device time alone, benchmarks.timing.graph_ms) where the
step can be captured, and median ms (do_bench) always, with the share of the device's copy bandwidth by the bytes a
step must move (28, 20 and about 16 B per parameter). The default timing command of tools/gpu_ab.sh.

    PYTHONPATH=. python3 tools/gpu_adam_times.py [layers [width]]   (default 32 layers of width 1024)
"""

import sys

import torch

import fused
from benchmarks.bench_optim import make_params, model_shapes
from benchmarks.run import copy_bandwidth_gbps
from benchmarks.timing import graph_ms, median_ms

STATES = {"fp32": (None, 28.0), "bf16": (torch.bfloat16, 20.0), "int8": ("int8", 16.0625)}  # B/param moved


def run(layers=32, width=1024, device="cuda"):
    """Prints one line per backend and state; on the CPU (a smoke run) the median alone, against no copy figure."""
    params = make_params(model_shapes(width, layers), torch.float32, device)
    n = sum(p.numel() for p in params)
    on_gpu = device == "cuda"
    copy = copy_bandwidth_gbps() if on_gpu else None
    name = torch.cuda.get_device_name() if on_gpu else "cpu"
    print(f"{name}; {n / 1e6:.1f}M params; copy {copy or 0:.0f} GB/s")
    try:
        for backend in ("cuda", "triton"):
            fused.set_backend(backend)
            for state, (state_dtype, bytes_per_param) in STATES.items():
                opt = fused.optim.AdamW(params, lr=1e-3, state_dtype=state_dtype)
                opt.step()  # the state's allocation
                median = median_ms(opt.step, device)
                graph = graph_ms(opt.step) if on_gpu else None
                best = graph if graph is not None else median
                pct = 100 * bytes_per_param * n / (best * 1e-3) / 1e9 / copy if copy else 0.0
                graph_text = f"{graph:8.3f}" if graph is not None else "       -"
                label = f"fused[{backend}] state {state}:"
                print(f"{label:28s} median {median:8.3f} ms  graph {graph_text} ms  {pct:5.1f}% of copy")
                del opt
    finally:
        fused.set_backend("auto")


if __name__ == "__main__":
    run(*map(int, sys.argv[1:3]))
