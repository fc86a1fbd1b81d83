"""Benchmark cases of the norm family: residual add + RMSNorm / LayerNorm (and the norms alone) on rows x hidden
8192 x 1024 and 2048 x 4096, float32 and bfloat16, forward and forward+backward. Alternatives: eager (x + r, then
F.rms_norm / F.layer_norm: torch's native norm kernels, aten::_fused_rms_norm and aten::native_layer_norm; torch
has no CPU RMSNorm backward kernel, so that backward is composite), the same norms written out in primitive ops
(as HF's LlamaRMSNorm and a hand-written LayerNorm), and torch.compile of the eager reference."""

import torch

import fused
from benchmarks.common import our_labels, with_backend
from fused.norm import reference as ref


def ours(device):
    return our_labels(device, lambda: fused.rms_norm(torch.ones(2, 8, device=device), 8))


def formula_rms_norm(h, ns, weight, eps=None):
    eps = torch.finfo(torch.float32).eps if eps is None else eps
    v = h.float()
    v = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    return (v * weight).to(h.dtype)


def formula_layer_norm(h, ns, weight, bias, eps=1e-5):
    v = h.float()
    mean = v.mean(-1, keepdim=True)
    v = (v - mean) * torch.rsqrt((v - mean).pow(2).mean(-1, keepdim=True) + eps)
    return (v * weight + bias).to(h.dtype)


def with_add(norm):
    def fn(x, r, ns, *params):
        h = x + r
        return norm(h, ns, *params), h

    return fn


def forward_and_backward(fn, inputs, grads):
    """A zero-argument call of fn on inputs (tensors first, then constants) and its backward with `grads`."""
    tensors = [t for t in inputs if isinstance(t, torch.Tensor)]

    def run():
        out = fn(*inputs)
        return torch.autograd.grad(out, tensors, grads[: len(out)] if isinstance(out, tuple) else grads[0])

    return run


def make_cases(device, name, impls, inputs, grads, fwd_bytes, bwd_bytes):
    """Forward and forward+backward cases; impls: label -> (function, backend or None)."""
    fwd = {label: with_backend(backend, lambda fn=fn: fn(*inputs)) for label, (fn, backend) in impls.items()}
    cases = [{"name": f"{name} fwd", "bytes": fwd_bytes, "impls": fwd}]
    grad_inputs = [t.detach().requires_grad_() if isinstance(t, torch.Tensor) else t for t in inputs]
    bwd = {
        label: with_backend(backend, forward_and_backward(fn, grad_inputs, grads))
        for label, (fn, backend) in impls.items()
    }
    cases.append({"name": f"{name} fwd+bwd", "bytes": fwd_bytes + bwd_bytes, "impls": bwd})
    return cases


def cases(device, quick):
    # every compiled case is the same function code under other guards (shape, dtype, kind): dynamo's default of
    # 8 versions per code object would run the later cases uncompiled
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    shapes = [(256, 1024)] if quick else [(8192, 1024), (2048, 4096)]
    out = []
    for rows, cols in shapes:
        for dtype in (torch.float32, torch.bfloat16):
            size = torch.finfo(dtype).bits // 8
            n = rows * cols * size
            tag = f"{rows}x{cols} {str(dtype)[6:]}"
            x, r = (
                torch.randn(rows, cols, device=device, dtype=dtype),
                torch.randn(rows, cols, device=device, dtype=dtype),
            )
            w, b = torch.rand(cols, device=device, dtype=dtype) + 0.5, torch.randn(cols, device=device, dtype=dtype)
            grads = [torch.randn(rows, cols, device=device, dtype=dtype) for _ in range(2)]
            for kind, params, formula in (
                ("rms_norm", [w], formula_rms_norm),
                ("layer_norm", [w, b], formula_layer_norm),
            ):
                for add in (True, False):
                    eager = getattr(ref, kind) if not add else with_add(getattr(ref, kind))
                    impls = {
                        "eager": (eager, None),
                        "eager formula": (with_add(formula) if add else formula, None),
                        "torch.compile": (torch.compile(eager), None),
                    }
                    fn = getattr(fused, ("add_" if add else "") + kind)
                    for label, backend in ours(device).items():
                        impls[label] = (fn, backend)
                    args = ([x, r] if add else [x]) + [(cols,)] + params
                    # bytes that must move: x (and r) read, the norm (and the sum) written; backward: the output
                    # gradients (and h's) and h read, grad_h written (x's and r's gradient alike)
                    out += make_cases(
                        device,
                        f"{'add+' if add else ''}{kind} {tag}",
                        impls,
                        args,
                        grads,
                        (4 if add else 2) * n,
                        (4 if add else 3) * n,
                    )
    for case in out:  # make bench's default: each op and dtype forward, at the shape issue 22 measured (FULL=1: all);
        # on a GPU, where a step takes microseconds, forward+backward too
        case["default"] = case["name"].split()[1] in ("8192x1024", "256x1024") and (
            case["name"].endswith(" fwd") or device == "cuda"
        )
    return out
