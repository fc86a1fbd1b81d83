"""Timing and memory measurement: torch.utils.benchmark on CPU, triton.testing.do_bench (CUDA events, L2
flushed between runs) on GPU; medians everywhere."""

import contextlib
import gc
import os
import sys

import torch


def median_ms(fn, device: str, min_run_time: float = 0.5) -> float:
    if device == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))
    from torch.utils import benchmark

    fn()  # warm-up: compilation, allocator, caches
    timer = benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=min_run_time).median * 1e3


def peak_memory_mb(fn, device: str):
    """Peak memory one call allocates beyond what was live before it. CUDA: the caching allocator's statistics.
    CPU (torch keeps no CPU allocator statistics): the running sum of the profiler's allocation records, so
    tensors only; a C++ kernel's own scratch (std::vector, a few tile-sized buffers) is not counted."""
    if device != "cuda":
        return _cpu_peak_mb(fn)
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


@contextlib.contextmanager
def _quiet_stderr():
    """Sends what C++ writes to stderr (file descriptor 2) to /dev/null: the profiler's kineto prints a USDT line at
    every start and stop, and the CPU allocator a warning about blocks allocated before profiling, at any log level."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def _cpu_peak_mb(fn):
    from torch.profiler import ProfilerActivity, profile

    gc.collect()
    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    records = sorted(
        (e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
    )  # + for an allocation, - for a free
    live = peak = 0
    for _, nbytes in records:
        live += nbytes
        peak = max(peak, live)
    return peak / 2**20


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    name = "CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{name}, {torch.get_num_threads()} threads"
