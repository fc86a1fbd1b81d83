"""python -m fused.info: version, device, compiled backends, and every op with the kernels it has."""

import os
import platform

import torch

import fused
from fused._backend import GPU_KERNELS, cuda_kernel_compiled, triton_available


def op_names():
    names = sorted(n[len("fused::") :] for n in torch._C._dispatch_get_all_op_names() if n.startswith("fused::"))
    return [n for n in names if not n.startswith("cuda_")]


def kernels(op):
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    composite = any(has(f"fused::{op}", k) for k in ("CompositeImplicitAutograd", "CompositeExplicitAutograd"))
    cpu = "C++" if has(f"fused::{op}", "CPU") else "composite" if composite else "-"
    gpu = GPU_KERNELS.get(op, {})
    cuda = "CUDA C++" if gpu.get("cuda") and cuda_kernel_compiled(gpu["cuda"]) else "-"
    triton = "Triton" if gpu.get("triton") and triton_available() else "-"
    return cpu, cuda, triton


def knn_gemm():
    """The CPU k-NN search's filter GEMM on this machine (the answer is the same either way)."""
    levels = fused._C.int8_gemm_levels()
    forced = os.environ.get("FUSED_KNN_FILTER")
    if fused._C.knn_filter(1 << 20, 768) == "float32":
        if forced:
            why = f"FUSED_KNN_FILTER={forced}"
        else:
            why = "torch's int8 GEMM is " + ("not oneDNN's x86 one here" if levels else "not exact here")
        return f"float32 ({why})"
    bits = "8-bit codes" if levels == 127 else "7-bit codes (no int8 dot products)"
    if forced:
        return f"int8, {bits} (FUSED_KNN_FILTER={forced})"
    return f"int8, {bits}, from 128 rows of a; float32 below"


def report() -> str:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    cuda_built = any(cuda_kernel_compiled(k["cuda"]) for k in GPU_KERNELS.values() if k.get("cuda"))
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({platform.processor() or 'cpu'})"
    lines = [
        f"fused {fused.__version__}",
        f"torch {torch.__version__} (CUDA {torch.version.cuda or 'none'}), triton {triton_version}, "
        f"Python {platform.python_version()}",
        f"device: {device}",
        f"compiled: CPU C++ yes, CUDA C++ {'yes' if cuda_built else 'no'}; Triton "
        f"{'available' if triton_version != 'not installed' else 'not available'}",
        f"GPU backend: {fused.get_backend()}",
        f"CPU k-NN GEMM (pairwise_topk, radius_neighbors at p=2, D >= 32): {knn_gemm()}",
        "",
        f"{'op':32} {'cpu':10} {'cuda':10} {'triton':8}",
    ]
    for op in op_names():
        cpu, cuda, triton_k = kernels(op)
        lines.append(f"{op:32} {cpu:10} {cuda:10} {triton_k:8}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(report())
