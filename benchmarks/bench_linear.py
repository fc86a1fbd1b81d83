"""Benchmarks of the fused linear family: linear_act and FusedMLP against nn.Linear + activation (eager),
torch.compile of the reference, and on GPU the cuBLAS GEMM alone (torch.mm: the floor for the forward)."""

import torch

import fused
from benchmarks.common import with_backend
from fused.elementwise.reference import ACT_FNS
from fused.linear.reference import linear_act as reference


def _fwd_bwd(fn, inputs):
    def run():
        out = fn()
        torch.autograd.grad(out, inputs, torch.ones_like(out))

    return run


def _linear_cases(device, M, K, N, dtype, act):
    x = torch.randn(M, K, device=device, dtype=dtype)
    layer = torch.nn.Linear(K, N, device=device, dtype=dtype)
    w, b = layer.weight.detach(), layer.bias.detach()
    compiled = torch.compile(reference)
    impls = {
        "eager": lambda xx, ww, bb: ACT_FNS[act](torch.nn.functional.linear(xx, ww, bb)),
        "torch.compile": lambda xx, ww, bb: compiled(xx, ww, bb, act),
    }
    if device == "cpu":
        impls["fused"] = lambda xx, ww, bb: fused.linear_act(xx, ww, bb, act)
    else:
        for backend in ("cuda", "triton"):
            impls[f"fused[{backend}]"] = with_backend(backend, lambda xx, ww, bb: fused.linear_act(xx, ww, bb, act))
        impls["torch.mm (cuBLAS floor)"] = lambda xx, ww, bb: torch.mm(xx, ww.t())  # no bias, no activation
    size = torch.finfo(dtype).bits // 8
    name = f"linear_act {act} {M}x{K}x{N} {str(dtype).replace('torch.', '')}"
    io_bytes = (M * K + N * K + N + M * N) * size
    fwd = {
        "name": f"{name} fwd",
        "bytes": io_bytes,
        "flops": 2 * M * N * K,
        "impls": {label: (lambda f: lambda: f(x, w, b))(f) for label, f in impls.items()},
    }
    xg, wg, bg = (t.clone().requires_grad_(True) for t in (x, w, b))
    bwd = {
        "name": f"{name} fwd+bwd",
        "bytes": 2 * io_bytes,
        "flops": 6 * M * N * K,
        "impls": {
            label: _fwd_bwd((lambda f: lambda: f(xg, wg, bg))(f), (xg, wg, bg))
            for label, f in impls.items()
            if "floor" not in label
        },
    }
    return [fwd, bwd]


def _mlp_cases(device, sizes, M, dtype, act):
    torch.manual_seed(0)
    mlp = fused.nn.FusedMLP(sizes, act=act, device=device, dtype=dtype)
    seq = []
    for layer in mlp.layers:
        lin = torch.nn.Linear(layer.in_features, layer.out_features, device=device, dtype=dtype)
        lin.load_state_dict(layer.state_dict())
        seq += [lin, torch.nn.GELU() if layer.act == "gelu" else torch.nn.Identity()]
    seq = torch.nn.Sequential(*seq)
    compiled = torch.compile(seq)
    x = torch.randn(M, sizes[0], device=device, dtype=dtype, requires_grad=True)
    models = {"eager": seq, "torch.compile": compiled}
    if device == "cpu":
        models["fused"] = mlp
    else:
        models.update({f"fused[{b}]": with_backend(b, mlp) for b in ("cuda", "triton")})
    params = {"eager": list(seq.parameters()), "torch.compile": list(seq.parameters())}
    params.update({k: list(mlp.parameters()) for k in models if k.startswith("fused")})
    flops = 2 * M * sum(a * b for a, b in zip(sizes, sizes[1:]))
    name = f"FusedMLP {'-'.join(map(str, sizes))} {act} M={M} {str(dtype).replace('torch.', '')}"
    fwd = {
        "name": f"{name} fwd",
        "bytes": None,
        "flops": flops,
        "impls": {k: (lambda m: lambda: m(x.detach()))(m) for k, m in models.items()},
    }
    bwd = {
        "name": f"{name} fwd+bwd",
        "bytes": None,
        "flops": 3 * flops,
        "impls": {k: _fwd_bwd((lambda m: lambda: m(x))(m), [x] + params[k]) for k, m in models.items()},
    }
    return [fwd, bwd]


def cases(device: str, quick: bool) -> list:
    if device == "cpu":
        if quick:
            return _linear_cases(device, 64, 96, 80, torch.float32, "gelu") + _mlp_cases(
                device, [64, 128, 64], 32, torch.float32, "gelu"
            )
        out = (
            _linear_cases(device, 2048, 1024, 1024, torch.float32, "gelu")
            + _linear_cases(device, 2048, 1024, 1024, torch.float32, "relu")
            + _mlp_cases(device, [1024, 4096, 1024], 2048, torch.float32, "gelu")
        )
        for case in out:  # make bench's default: linear_act (relu is the same op) and the MLP, forward
            case["default"] = case["name"].endswith(" fwd") and " relu " not in case["name"]
        return out
    if quick:
        return _linear_cases(device, 256, 512, 384, torch.bfloat16, "gelu")
    shapes = [(4096, 4096, 4096), (8192, 4096, 1024), (8192, 1024, 4096)]
    out = []
    for M, K, N in shapes:
        out += _linear_cases(device, M, K, N, torch.bfloat16, "gelu")
    out += _linear_cases(device, 4096, 4096, 4096, torch.bfloat16, "relu")
    out += _mlp_cases(device, [1024, 4096, 1024], 8192, torch.bfloat16, "gelu")
    return out
