"""Benchmark cases of the fused elementwise family: bias+GELU, SwiGLU, ten x*x, cos(cos(x)), on 8M elements,
forward and forward+backward, against eager, torch.compile and each of our backends."""

import torch

import fused
from benchmarks.common import forward_and_backward, our_labels, with_backend
from fused.elementwise import reference as ref


def ours(device):
    return our_labels(device, lambda: fused.bias_act(torch.ones(8, device=device), None, "relu"))


def make_cases(device, quick, name, fn_ref, fn_ours, inputs, out_numel, fwd_bytes, bwd_bytes):
    """Forward and forward+backward cases for one op: fn_ref is the eager reference (also compiled)."""
    compiled = torch.compile(fn_ref)
    cases = []
    impls = {"eager": lambda: fn_ref(*inputs), "torch.compile": lambda: compiled(*inputs)}
    for label, backend in ours(device).items():
        impls[label] = with_backend(backend, lambda: fn_ours(*inputs))
    cases.append({"name": f"{name} fwd", "bytes": fwd_bytes, "impls": impls})
    grad_inputs = [t.detach().requires_grad_() for t in inputs]
    grad = torch.randn(out_numel, device=device, dtype=inputs[0].dtype).view(fn_ref(*inputs).shape)
    impls = {
        "eager": forward_and_backward(fn_ref, grad_inputs, grad),
        "torch.compile": forward_and_backward(compiled, grad_inputs, grad),
    }
    for label, backend in ours(device).items():
        impls[label] = with_backend(backend, forward_and_backward(fn_ours, grad_inputs, grad))
    cases.append({"name": f"{name} fwd+bwd", "bytes": fwd_bytes + bwd_bytes, "impls": impls})
    return cases


def ref_and_ours(op, *options):
    """The reference and our op of one name, with the trailing options bound."""
    return (lambda *t: getattr(ref, op)(*t, *options)), (lambda *t: getattr(fused, op)(*t, *options))


def cases(device, quick):
    rows, cols = (256, 1024) if quick else (8192, 1024)  # 8M elements
    dtypes = [torch.float32] if device == "cpu" else [torch.float32, torch.bfloat16]
    out = []
    for dtype in dtypes:
        size = torch.finfo(dtype).bits // 8
        n = rows * cols
        tag = f"{rows}x{cols} {str(dtype)[6:]}"
        x = torch.randn(rows, cols, device=device, dtype=dtype)
        b = torch.randn(cols, device=device, dtype=dtype)
        h = torch.randn(rows, 2 * cols, device=device, dtype=dtype)
        gate, up = h[:, :cols], h[:, cols:]
        # (name, (reference, ours), inputs, elements moved forward, and backward, in units of n)
        ops = [
            ("bias+gelu", ref_and_ours("bias_act", "gelu"), [x, b], 2, 3),
            ("swiglu", ref_and_ours("glu", "silu"), [gate, up], 3, 5),
            ("ten x*x", ref_and_ours("unary_chain", ["square"] * 10), [x], 2, 3),
            ("cos(cos(x))", ref_and_ours("unary_chain", ["cos", "cos"]), [x], 2, 3),
        ]
        for name, (fn_ref, fn_ours), inputs, fwd, bwd in ops:
            out += make_cases(
                device, quick, f"{name} {tag}", fn_ref, fn_ours, inputs, n, fwd * n * size, bwd * n * size
            )
    for case in out:  # make bench's default: each op forward (cos(cos(x)) is unary_chain again; FULL=1: all)
        case["default"] = case["name"].endswith(" fwd") and not case["name"].startswith("cos(cos(x))")
    return out
