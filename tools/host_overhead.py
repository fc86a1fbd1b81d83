"""Host time of one eager call, fused against torch, on small tensors where the device finishes each call before
the host issues the next: what a training step pays in Python, dispatch and launches per op. Then the Python
profile (cProfile, by own time) of the fused call furthest behind torch's. On a GPU each fused op runs once per backend.

    python3 tools/host_overhead.py        (tools/gpu_diag.sh runs it on a lent GPU machine: diag.log)
"""

import cProfile
import io
import pstats
import time

import torch
import torch.nn.functional as F

import fused

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ("cuda", "triton") if DEVICE == "cuda" else ("cpu",)


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def host_us(fn, calls=300):
    """Microseconds of host time per call: the best of 3 runs of `calls` calls, the device drained before each."""
    fn()
    best = float("inf")
    for _ in range(3):
        sync()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    sync()
    return best


def fwd_bwd(fn, *inputs):
    def run():
        out = fn()
        out = out[0] if isinstance(out, tuple) else out
        torch.autograd.grad(out, inputs, torch.ones_like(out))

    return run


def cases():
    x = torch.randn(64, 1024, device=DEVICE, requires_grad=True)
    r = torch.randn(64, 1024, device=DEVICE, requires_grad=True)
    w = torch.ones(1024, device=DEVICE, requires_grad=True)
    b = torch.zeros(1024, device=DEVICE, requires_grad=True)
    lin = torch.randn(256, 1024, device=DEVICE, requires_grad=True)
    xd, wd, bd = x.detach(), w.detach(), b.detach()
    return [
        ("rms_norm fwd (no grad)", lambda: F.rms_norm(xd, (1024,), wd), lambda: fused.rms_norm(xd, (1024,), wd)),
        ("rms_norm fwd", lambda: F.rms_norm(x, (1024,), w), lambda: fused.rms_norm(x, (1024,), w)),
        (
            "rms_norm fwd+bwd",
            fwd_bwd(lambda: F.rms_norm(x, (1024,), w), x, w),
            fwd_bwd(lambda: fused.rms_norm(x, (1024,), w), x, w),
        ),
        (
            "layer_norm fwd+bwd",
            fwd_bwd(lambda: F.layer_norm(x, (1024,), w, b), x, w, b),
            fwd_bwd(lambda: fused.layer_norm(x, (1024,), w, b), x, w, b),
        ),
        (
            "add+rms_norm fwd+bwd",
            fwd_bwd(lambda: F.rms_norm(x + r, (1024,), w), x, r, w),
            fwd_bwd(lambda: fused.add_rms_norm(x, r, (1024,), w), x, r, w),
        ),
        ("bias+gelu fwd (no grad)", lambda: F.gelu(xd + bd), lambda: fused.bias_act(xd, bd, "gelu")),
        (
            "bias+gelu fwd+bwd",
            fwd_bwd(lambda: F.gelu(x + b), x, b),
            fwd_bwd(lambda: fused.bias_act(x, b, "gelu"), x, b),
        ),
        (
            "linear+gelu fwd+bwd",
            fwd_bwd(lambda: F.gelu(F.linear(x, lin, None)), x, lin),
            fwd_bwd(lambda: fused.linear_act(x, lin, None, "gelu"), x, lin),
        ),
    ]


def main():
    print(f"host time per call, us ({DEVICE}; torch {torch.__version__}; fused {fused.__version__})")
    print(f"{'case':26} {'torch':>8} " + " ".join(f"{'fused[' + b + ']':>14}" for b in BACKENDS))
    slowest = (-float("inf"), None, None)  # the fused call furthest behind torch's
    for name, ref, ours in cases():
        row = [host_us(ref)]
        for backend in BACKENDS:
            if DEVICE == "cuda":
                fused.set_backend(backend)
            row.append(host_us(ours))
            if row[-1] - row[0] > slowest[0]:
                slowest = (row[-1] - row[0], f"{name} fused[{backend}]", (backend, ours))
        print(f"{name:26} " + " ".join(f"{t:8.1f}" if k == 0 else f"{t:14.1f}" for k, t in enumerate(row)))
    _, label, (backend, fn) = slowest
    if DEVICE == "cuda":
        fused.set_backend(backend)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(200):
        fn()
    profile.disable()
    sync()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(20)
    print(f"\nprofile of 200 calls of {label} (own time first):")
    print("\n".join(line for line in text.getvalue().splitlines() if line.strip())[:6000])
    fused.set_backend("auto")


if __name__ == "__main__":
    main()
