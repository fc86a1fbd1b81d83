"""The benchmark suite: every benchmarks/bench_<family>.py case, each implementation timed on one device.
Writes a markdown table and JSON to benchmarks/results/, named by device and date, then a PNG chart (with
matplotlib; without it, the run says how to get it).

    python -m benchmarks.run [--device cpu|cuda] [--only elementwise,distance] [--full] [--quick] [--thp] [--out DIR]

By default a representative case per op and dtype (the cases a family marks "default", else its first case of
each op and dtype), 3 rounds: the whole table in about 10 minutes on a 2-core CPU. --full (make bench FULL=1):
every case, 5 rounds.

--thp runs with THP_MEM_ALLOC_ENABLE=1 (torch's CPU allocator then backs large tensors with transparent huge
pages). On Linux with THP in madvise mode, a fresh 32 MB output otherwise costs 8192 page faults, each zeroing
4 KB in the kernel: that is most of the time of every memory-bound op here (eager, compiled and ours alike), and
--thp shows what the kernels themselves cost. The default run measures the default environment.

--keep-heap makes glibc's malloc keep what it frees (no mmap for large blocks, no trimming of the heap's top), as
a caching allocator (jemalloc, tcmalloc) does: after a few calls, a call reuses the memory its previous call
freed. By default, whether a call reuses freed memory or page-faults in fresh memory turns on glibc's thresholds
and on what ran before it, so the same case's ratio can move by 3x with the order of the run. With --keep-heap
the timed calls rarely fault, and the figures depend far less on that order.
"""

import argparse
import datetime
import gc
import importlib
import json
import os
import pkgutil
import re
import statistics
import sys
import time

import torch

from benchmarks.common import built
from benchmarks.timing import device_name, graph_ms, median_ms, peak_memory_mb

OURS = ("fused", "fused[cuda]", "fused[triton]")


def is_ours(label: str) -> bool:
    """fused's rows: "fused", "fused[cuda]", "fused[triton]", and their variants ("fused[cuda] state_dtype=int8")."""
    return label.split(" ")[0] in OURS


def discover(only):
    """The families' modules: all, alphabetically, or those named in `only`, in its order."""
    modules = pkgutil.iter_modules([os.path.dirname(__file__)])
    names = sorted(m.name[len("bench_") :] for m in modules if m.name.startswith("bench_"))
    return [importlib.import_module(f"benchmarks.bench_{n}") for n in (only or names) if n in names]


def op_and_dtype(name):
    """A case's op and dtype: its name without the direction (fwd, fwd+bwd) and the tokens other than dtypes that
    hold a number (shapes, sizes, k=16)."""
    dtypes = ("float16", "bfloat16", "float32", "float64", "fp16", "bf16")
    words = [t for t in name.split() if t in dtypes or not re.search(r"\d", t)]
    return " ".join(t for t in words if t not in ("fwd", "fwd+bwd"))


def default_cases(cases):
    """One family's representative cases: those it marks "default" when it marks any, else its first case of each
    op and dtype."""
    if any(c.get("default") for c in cases):
        return [c for c in cases if c.get("default")]
    first = {}
    for c in cases:
        first.setdefault(op_and_dtype(c["name"]), c)
    return list(first.values())


def measure(case, device, min_run_time, rounds):
    """Times every implementation `rounds` times, interleaved (A B C A B C ...), and keeps the median per
    implementation: on a shared, noisy machine a drift then hits every implementation alike."""
    times = {label: [] for label in case["impls"]}
    errors = {}
    for _ in range(rounds):
        for label, fn in case["impls"].items():
            if label in errors:
                continue
            try:
                times[label].append(median_ms(fn, device, min_run_time))
            except Exception as e:  # an alternative that fails (OOM, unsupported) is reported, not fatal
                errors[label] = f"{type(e).__name__}: {e}"[:200]
    rows = []
    for label, fn in case["impls"].items():
        if label in errors:
            rows.append({"impl": label, "ms": None, "peak_mb": None, "error": errors[label]})
        else:
            rows.append(
                {
                    "impl": label,
                    "ms": statistics.median(times[label]),
                    "peak_mb": peak_memory_mb(fn, device),
                    "error": None,
                }
            )
            if device == "cuda":
                rows[-1]["graph_ms"] = graph_ms(fn)
            if label in case.get("resident_mb", {}):  # memory held between steps (model, grads, state)
                rows[-1]["resident_mb"] = case["resident_mb"][label]()
    eager = next((r["ms"] for r in rows if r["impl"] == "eager" and r["ms"]), None)
    alternatives = [r["ms"] for r in rows if not is_ours(r["impl"]) and r["ms"]]
    best_alt = min(alternatives) if alternatives else None
    for r in rows:
        if r["ms"]:
            if case.get("bytes"):
                r["GB/s"] = case["bytes"] / r["ms"] / 1e6
            if case.get("flops"):
                r["TFLOP/s"] = case["flops"] / r["ms"] / 1e9
            r["vs_eager"] = eager / r["ms"] if eager else None
            r["vs_best_alt"] = best_alt / r["ms"] if best_alt and is_ours(r["impl"]) else None
    return rows


def copy_bandwidth_gbps(nbytes=2**30):
    """The device's copy bandwidth, the ceiling of a memory-bound op: a 1 GiB device-to-device copy, bytes read plus
    bytes written over its median time."""
    src = torch.randn(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), "cuda")
    return 2 * nbytes / ms / 1e6


def fmt(v, spec):
    return "-" if v is None else format(v, spec)


def markdown(results, header, copy_gbps=None):
    # GPU tables: "graph ms", the device time alone (benchmarks.timing.graph_ms), beside do_bench's median
    graphs = any("graph_ms" in r for case in results for r in case["rows"])
    lines = [
        header,
        "",
        f"| case | impl | median ms |{' graph ms |' if graphs else ''} GB/s | % copy | TFLOP/s | peak MB | vs eager | "
        "vs best alternative |",
        f"|---|---|---:|{'---:|' if graphs else ''}---:|---:|---:|---:|---:|---:|",
    ]
    for case in results:
        for r in case["rows"]:
            if r["error"]:
                lines.append(f"| {case['name']} | {r['impl']} | failed: {r['error'][:60]} |{' |' * (7 + graphs)}")
                continue
            graph = f" {fmt(r.get('graph_ms'), '.3f')} |" if graphs else ""
            lines.append(
                f"| {case['name']} | {r['impl']} | {fmt(r['ms'], '.3f')} |{graph} {fmt(r.get('GB/s'), '.1f')} | "
                f"{fmt(copy_pct(r.get('GB/s'), copy_gbps), '.0f')} | "
                f"{fmt(r.get('TFLOP/s'), '.2f')} | {fmt(r['peak_mb'], '.1f')} | {fmt(r.get('vs_eager'), '.2f')}x | "
                f"{fmt(r.get('vs_best_alt'), '.2f')}{'x' if r.get('vs_best_alt') else ''} |"
            )
    held = [
        f"{c['name']} [{r['impl']}]: {r['resident_mb']:.1f} MB"
        for c in results
        for r in c["rows"]
        if r.get("resident_mb") is not None
    ]
    if held:
        lines += ["", "Memory held between steps (model, gradients, master copies, optimizer state):", ""]
        lines += [f"- {h}" for h in held]
    return "\n".join(lines) + "\n"


def copy_pct(gbps, copy_gbps):
    return 100 * gbps / copy_gbps if gbps and copy_gbps else None


def chart(results, path, title):
    """One bar per case and backend of ours: its speedup over eager and over the best alternative (log scale).
    Without matplotlib: no chart, and one line that says how to get it; returns whether it wrote the chart."""
    try:
        import matplotlib
    except ImportError:
        print(f"chart skipped: matplotlib is not installed (pip install matplotlib, or pip install .[bench]); {path}")
        return False

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = [
        (f"{c['name']} [{r['impl']}]" if r["impl"] != "fused" else c["name"], r.get("vs_eager"), r.get("vs_best_alt"))
        for c in results
        for r in c["rows"]
        if is_ours(r["impl"]) and r["ms"]
    ]
    fig, ax = plt.subplots(figsize=(10, 0.28 * len(bars) + 1.5))
    y = range(len(bars))
    ax.barh([i - 0.2 for i in y], [b[1] or 0 for b in bars], 0.4, label="vs eager")
    ax.barh([i + 0.2 for i in y], [b[2] or 0 for b in bars], 0.4, label="vs best alternative")
    ax.set_yticks(list(y), [b[0] for b in bars], fontsize=7)
    ax.set_xscale("log")
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_xlabel("speedup (higher is better; 1 = as fast)")
    ax.set_title(title, fontsize=9)
    ax.invert_yaxis()
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")  # long case names stay whole
    return True


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    p.add_argument(
        "--only",
        default="",
        help="comma-separated families (elementwise, linear, distance, geometry, loss, norm, optim, rope)",
    )
    p.add_argument("--match", default="", help="only the cases whose name contains this text (or one of a|b|c's parts)")
    p.add_argument("--quick", action="store_true", help="small shapes, short timing: a smoke run")
    p.add_argument("--threads", type=int, default=2, help="CPU threads (the targets are stated for 2)")
    p.add_argument("--full", action="store_true", help="every case (default: a representative case per op and dtype)")
    p.add_argument("--rounds", type=int, help="interleaved timing rounds per case, median kept (default 3; --full 5)")
    p.add_argument("--thp", action="store_true", help="CPU: transparent huge pages for large tensors (see above)")
    p.add_argument("--keep-heap", action="store_true", help="CPU: malloc keeps freed memory (see above)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    p.add_argument("--budget-s", type=float, help="start no new case after this many seconds")
    args = p.parse_args(argv)
    if args.thp and os.environ.get("THP_MEM_ALLOC_ENABLE") != "1":
        # torch reads the variable once, at its first allocation: start again with it set.
        os.environ["THP_MEM_ALLOC_ENABLE"] = "1"
        os.execv(sys.executable, [sys.executable, "-m", "benchmarks.run", *(sys.argv[1:] if argv is None else argv)])
    if args.keep_heap:
        keep_freed_heap()
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    from rich.progress import Progress

    import fused  # noqa: F401

    modules = discover([s for s in args.only.split(",") if s])
    copy_gbps = copy_bandwidth_gbps() if args.device == "cuda" else None
    results = []
    with Progress() as progress:
        rounds = args.rounds or (5 if args.full else 3)
        task = progress.add_task(f"benchmarks on {args.device}", total=None)
        started = time.monotonic()
        # One family at a time: its cases' tensors are made, timed and freed before the next family's are made.
        for m in modules:
            if args.budget_s and time.monotonic() - started > args.budget_s:
                print(f"budget of {args.budget_s:.0f} s spent: {m.__name__} and the families after it not run")
                break
            try:
                found = m.cases(args.device, args.quick)
            except Exception as e:  # one family that cannot set up (a missing API, OOM) leaves the others
                print(f"{m.__name__}: no cases ({type(e).__name__}: {e})"[:300])
                continue
            wanted = args.match.split("|")
            chosen = found if args.full or args.quick else default_cases(found)
            cases = [c for c in chosen if any(part in c["name"] for part in wanted)]
            del found
            for case in cases:
                if args.budget_s and time.monotonic() - started > args.budget_s:
                    break
                progress.update(task, description=case["name"])
                built(case)
                results.append(
                    {
                        "name": case["name"],
                        "bytes": case.get("bytes"),
                        "flops": case.get("flops"),
                        "rows": measure(case, args.device, 0.05 if args.quick else 0.3, 1 if args.quick else rounds),
                    }
                )
                progress.advance(task)
                del case["impls"]
                write(results, args, copy_gbps, final=False)  # a run cut short keeps what it measured
            del cases
            gc.collect()
            if args.device == "cuda":
                torch.cuda.empty_cache()
    write(results, args, copy_gbps, final=True)


def keep_freed_heap():
    """--keep-heap: glibc's malloc serves every block from its heap (no mmap) and never trims the heap's top."""
    import ctypes

    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # malloc.h
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(M_MMAP_MAX, 0) and libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1)
    except (OSError, AttributeError):
        ok = False
    if not ok:
        sys.exit("benchmarks.run: --keep-heap needs glibc's mallopt")


def write(results, args, copy_gbps, final):
    import fused

    date = datetime.date.today().isoformat()
    name = device_name(args.device)
    header = (
        f"## Benchmarks on {name} ({date}; torch {torch.__version__}, fused backend "
        f"{fused.get_backend()}{', THP_MEM_ALLOC_ENABLE=1' if args.thp else ''}"
        f"{', freed heap kept' if args.keep_heap else ''}"
        f"{', quick' if args.quick else ''}{', full' if args.full else ''})"
    )
    slug = (
        re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-").lower()
        + ("-thp" if args.thp else "")
        + ("-keep-heap" if args.keep_heap else "")
        + ("-quick" if args.quick else "")
    )
    title = header[3:]
    if copy_gbps:
        header += f"\n\nDevice-to-device copy in this run: {copy_gbps:.0f} GB/s (read + written); % copy: GB/s over it."
    os.makedirs(args.out, exist_ok=True)
    base = os.path.join(args.out, f"{slug}")
    table = markdown(results, header, copy_gbps)
    with open(base + ".md", "w") as f:
        f.write(table)
    with open(base + ".json", "w") as f:
        json.dump(
            {"device": name, "date": date, "torch": torch.__version__, "copy_GBps": copy_gbps, "results": results},
            f,
            indent=1,
        )
    if not final:
        return
    print(table)
    print(f"wrote {base}.md, .json")
    if chart(results, base + ".png", title):
        print(f"wrote {base}.png")


if __name__ == "__main__":
    main()
