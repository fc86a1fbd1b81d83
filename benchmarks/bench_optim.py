"""Clip-and-step: fused.optim.X(max_grad_norm=1.0).step() against clip_grad_norm_ + torch.optim.X, in three
flavours of torch (for-loop "eager", "foreach", and torch's best: clip_grad_norm_(foreach=True) + X(fused=True)).
Every one leaves the clipped gradient in .grad. First, plain AdamW with no clipping (fused's one-pass step, with
fp32, bf16 and int8 state, against torch's fused AdamW and bitsandbytes' AdamW8bit, with state bytes/param), on
fp32 params and (CPU) on bf16 params.
Bytes floor per parameter (fp32): AdamW 4 (norm reads g) + 32 (reads p, g, m, v; writes p, g, m, v); SGD with
momentum 4 + 24; bf16 AdamW with fp32 master weights 2 + 30 (against fp32 masters in torch's fused AdamW with
casts of the gradients in and the parameters out). The write of g is the .grad write-back: 4 B per parameter in
fp32, 2 B in bf16. torch.compile of a whole optimizer step is left out: it compiles for minutes at this size.

python benchmarks/bench_optim.py [cpu|cuda] [--quick] times the cases alone (and counts GPU kernel launches).
"""

import sys

import torch

import fused
from benchmarks.common import built, our_labels, with_backend


def model_shapes(d, layers):
    """A transformer-like parameter list: per layer qkv, proj, fc1, fc2 weights and three vectors (7 tensors)."""
    per_layer = [(3 * d, d), (d, d), (4 * d, d), (d, 4 * d), (d,), (3 * d,), (4 * d,)]
    return per_layer * layers


def make_params(shapes, dtype, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    params = [torch.randn(s, dtype=dtype, device=device, generator=g).requires_grad_() for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, dtype=dtype, device=device, generator=g)
    return params


def torch_step(params, opt, foreach):
    def step():
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=foreach)
        opt.step()

    return step


def ours(device):
    """(label, backend) of fused's steps: the CPU kernels, or each GPU backend that runs here (common.our_labels,
    probed with one clipped step)."""

    def probe():
        p = torch.zeros(8, device=device, requires_grad=True)
        p.grad = torch.ones_like(p)
        fused.optim.AdamW([p], max_grad_norm=1.0).step()

    return list(our_labels(device, probe).items())


def impls(name, shapes, dtype, device, hyper):
    """{label: zero-arg step}; each impl owns its parameters, gradients and state."""
    cls = getattr(torch.optim, name)
    out = {}
    p = make_params(shapes, dtype, device)
    out["eager"] = torch_step(p, cls(p, foreach=False, **hyper), foreach=False)
    p = make_params(shapes, dtype, device)
    out["foreach"] = torch_step(p, cls(p, foreach=True, **hyper), foreach=True)
    p = make_params(shapes, dtype, device)
    out[f"torch.optim.{name}(fused=True)"] = torch_step(p, cls(p, fused=True, **hyper), foreach=True)
    for label, backend in ours(device):
        p = make_params(shapes, dtype, device)
        out[label] = with_backend(backend, getattr(fused.optim, name)(p, max_grad_norm=1.0, **hyper).step)
    return out


def resident_mb(tensors, opts):
    """MB held by the given tensors, their .grad and the optimizers' state (each storage counted once)."""
    held = list(tensors) + [t.grad for t in tensors if t.grad is not None]
    held += [v for opt in opts for state in opt.state.values() for v in state.values() if torch.is_tensor(v)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in held}
    return sum(storages.values()) / 2**20


def master_impls(shapes, device):
    """bf16 model, fp32 master weights and moments. What users do today with torch: cast the bf16 gradients
    into fp32 .grad of fp32 master params, clip_grad_norm_ + AdamW on the masters, cast the masters back into
    the bf16 model. fused: one AdamW(master_weights=True) step on the bf16 params. Also returns, per impl, a
    call giving the memory it holds (model, gradients, masters, state) once it has stepped."""
    out, resident = {}, {}
    for label, kw in [("eager", dict(foreach=False)), ("torch.optim.AdamW(fused=True)+casts", dict(fused=True))]:
        model = make_params(shapes, torch.bfloat16, device)
        master = [p.detach().float().requires_grad_() for p in model]
        for m in master:
            m.grad = torch.empty_like(m)
        opt = torch.optim.AdamW(master, lr=1e-3, **kw)
        foreach = kw.get("fused", False)

        def step(model=model, master=master, opt=opt, foreach=foreach):
            torch._foreach_copy_([m.grad for m in master], [p.grad for p in model])
            torch.nn.utils.clip_grad_norm_(master, 1.0, foreach=foreach)
            opt.step()
            with torch.no_grad():
                torch._foreach_copy_(model, master)

        out[label] = step
        resident[label] = lambda model=model, master=master, opt=opt: resident_mb(model + master, [opt])
    for label, backend in ours(device):
        model = make_params(shapes, torch.bfloat16, device)
        opt = fused.optim.AdamW(model, lr=1e-3, master_weights=True, max_grad_norm=1.0)
        out[label] = with_backend(backend, opt.step)
        resident[label] = lambda model=model, opt=opt: resident_mb(model, [opt])
    return out, resident


def state_bytes(opt):
    """Bytes of optimizer state held per parameter: every state tensor but "step" and fp32 master copies (each
    storage counted once), over the parameters' elements."""
    params = [p for g in opt.param_groups for p in g["params"]]
    held = [
        v
        for state in opt.state.values()
        for k, v in state.items()
        if torch.is_tensor(v) and k not in ("step", "master_param") and v.dim() > 0
    ]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in held}
    return sum(storages.values()) / sum(p.numel() for p in params)


def plain_adamw_impls(shapes, device, with_torchao=False, dtype=torch.float32):
    """AdamW with no clipping and no scaler, the case most users try first: torch's fused step against fused's
    one-pass step, with fp32, bf16 and int8 state, and (fp32 params) the 8-bit optimizers of bitsandbytes and
    (with_torchao) torchao where they import. torchao's AdamW8bit compiles a step per parameter shape on its first
    step and runs its compiled step per parameter, so it only joins a smaller case. With bf16 params, torch's
    steps keep bf16 state (fused's default keeps fp32). Also returns, per impl, a call giving its state's bytes per
    parameter ("resident_mb" of the case holds that figure, not MB)."""
    out, state = {}, {}

    def add(label, make, backend=None):
        p = make_params(shapes, dtype, device)
        opt = make(p)
        out[label] = with_backend(backend, opt.step)
        state[label] = lambda opt=opt: state_bytes(opt)

    add("eager", lambda p: torch.optim.AdamW(p, lr=1e-3, foreach=False))
    add("torch.optim.AdamW(fused=True)", lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True))
    for label, backend in ours(device):
        add(label, lambda p: fused.optim.AdamW(p, lr=1e-3), backend)
        for kind, state_dtype in (("bf16", torch.bfloat16), ("int8", "int8")):
            make = lambda p, s=state_dtype: fused.optim.AdamW(p, lr=1e-3, state_dtype=s)  # noqa: E731
            add(f"{label} state_dtype={kind}", make, backend)
    if dtype != torch.float32:
        return out, state
    try:
        import bitsandbytes as bnb

        add("bitsandbytes AdamW8bit", lambda p: bnb.optim.AdamW8bit(p, lr=1e-3, min_8bit_size=4096))
    except ImportError:
        pass
    if with_torchao:
        try:
            from torchao.optim import AdamW8bit
        except ImportError:
            pass
        else:  # fused's block size (it keeps tensors under 4096 elements in fp32, as fused does)
            add("torchao AdamW8bit", lambda p: AdamW8bit(p, lr=1e-3, block_size=256))
    return out, state


def clip_cases(shapes, dtypes, device, default):
    """clip+AdamW and clip+SGD per dtype, then clip+AdamW on bf16 parameters with fp32 master weights."""
    n = sum(torch.Size(s).numel() for s in shapes)
    out = []
    for dtype in dtypes:
        size = torch.finfo(dtype).bits // 8
        for name, hyper, state_tensors in [("AdamW", dict(lr=1e-3), 2), ("SGD", dict(lr=1e-2, momentum=0.9), 1)]:
            # norm: read g; step: read p, g, each state tensor; write p, g (clipped) and each state tensor
            floor = n * size * (1 + (2 + state_tensors) + (2 + state_tensors))
            out.append(
                {
                    "name": f"clip+{name} {n / 1e6:.1f}M params in {len(shapes)} tensors {str(dtype)[6:]}",
                    "bytes": floor,
                    "flops": None,
                    "build": lambda name=name, dtype=dtype, hyper=hyper: {
                        "impls": impls(name, shapes, dtype, device, hyper)
                    },
                    "default": default,
                }
            )
    # bf16 params with fp32 master weights: norm reads g (2 B); step reads g, master, m, v (14 B) and writes
    # master, m, v, the bf16 param and the clipped bf16 g (16 B): 32 B per parameter.
    out.append(
        {
            "name": f"clip+AdamW bf16 master weights {n / 1e6:.1f}M params in {len(shapes)} tensors",
            "bytes": 32 * n,
            "flops": None,
            "build": lambda: dict(zip(("impls", "resident_mb"), master_impls(shapes, device))),
            "default": default,
        }
    )
    return out


def plain_case(shapes, device, with_torchao=False, dtype=torch.float32):
    """AdamW with no clipping: one pass reading p, g, m, v and writing p, m, v (28 B per fp32 parameter; 14 B for
    bf16 params and moments, the floor of torch's bf16 step), with fused's fp32, bf16 and int8 state. In the
    default run on a GPU (float32); on a CPU, FULL=1 (make bench's default AdamW float32 there is clip+AdamW)."""
    n = sum(torch.Size(s).numel() for s in shapes)
    return {
        "name": f"AdamW (no clipping) {n / 1e6:.1f}M params in {len(shapes)} tensors {str(dtype)[6:]}",
        "bytes": 7 * torch.finfo(dtype).bits // 8 * n,
        "flops": None,
        "build": lambda: dict(
            zip(("impls", "state_bytes_per_param"), plain_adamw_impls(shapes, device, with_torchao, dtype))
        ),
        "default": device == "cuda" and dtype == torch.float32,
    }


def cases(device: str, quick: bool) -> list:
    if device == "cpu":
        shapes, dtypes = (model_shapes(32, 4), [torch.float32]) if quick else (model_shapes(188, 32), [torch.float32])
    else:  # about 400M parameters in 224 tensors: 26 GB for the four fp32 AdamW steps of one case
        shapes, dtypes = (
            (model_shapes(64, 4), [torch.float32])
            if quick
            else (model_shapes(1024, 32), [torch.float32, torch.bfloat16])
        )
    out = []
    # no clipping: one pass reading p, g, m, v and writing p, m, v (28 B per fp32 parameter)
    plain_shapes = (model_shapes(32, 4) if quick else model_shapes(360, 32)) if device == "cpu" else shapes
    out.append(plain_case(plain_shapes, device))
    if device == "cpu" and not quick:
        out.append(plain_case(model_shapes(256, 2), device, with_torchao=True))
        out.append(plain_case(plain_shapes, device, dtype=torch.bfloat16))
    small_default = device == "cpu" and not quick
    out += clip_cases(shapes, dtypes, device, default=not small_default)
    if small_default:
        # make bench's default on a CPU: 3.6M params (57 MB of fp32 AdamW state, beyond the last-level cache), as
        # torch's for-loop and foreach steps take seconds at 13.6M on 2 cores (FULL=1 times both sizes)
        out += clip_cases(model_shapes(96, 32), dtypes, device, default=True)
    return out


def kernel_launches(fn, device):
    """Kernel launches of one call of fn, from torch.profiler (GPU only)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def main():
    from torch.utils import benchmark

    device = sys.argv[1] if len(sys.argv) > 1 and not sys.argv[1].startswith("-") else "cpu"
    quick = "--quick" in sys.argv
    for case in map(built, cases(device, quick)):
        print(f"## {case['name']}  (floor {case['bytes'] / 1e6:.0f} MB)")
        for label, fn in case["impls"].items():
            fn()  # state allocation, warm-up
            t = benchmark.Timer("fn()", globals={"fn": fn}).blocked_autorange(min_run_time=2.0).median
            extra = f"  launches/step {kernel_launches(fn, device)}" if device == "cuda" else ""
            if label in case.get("state_bytes_per_param", {}):
                extra += f"  state {case['state_bytes_per_param'][label]():.2f} B/param"
            print(f"{label:34s} {t * 1e3:9.2f} ms  {case['bytes'] / t / 1e9:7.1f} GB/s{extra}")
        case["impls"].clear()


if __name__ == "__main__":
    main()
