"""Timing and memory measurement: torch.utils.benchmark on CPU, triton.testing.do_bench (CUDA events, L2
flushed between runs) on GPU, and on GPU also the device time alone (graph_ms); medians everywhere."""

import contextlib
import gc
import os
import statistics
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


def graph_ms(fn, calls: int = 20):
    """fn's device time per call without the host's launch gaps: `calls` calls captured in one CUDA graph, each
    after an L2 flush (a 256 MB memset); the flushes alone, captured and replayed the same way, are taken off.
    Median of 10 replays. None where fn cannot be captured (a host sync, a CPU op in it)."""
    flush = torch.empty(2**26, dtype=torch.int32, device="cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def flushed():
        flush.zero_()
        fn()

    def per_call(body):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                body()
        times = []
        for _ in range(10):
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / calls)
        return statistics.median(times)

    try:
        fn()  # outside the capture: compilation, workspaces, lazy initialisation
        torch.cuda.synchronize()
        return max(per_call(flushed) - per_call(flush.zero_), 0.0)
    except Exception:  # not capturable: the do_bench time stands alone
        torch.cuda.synchronize()
        return None


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
