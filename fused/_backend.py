"""Which GPU implementation runs each op: the CUDA C++ kernel or the Triton kernel.

`fused.set_backend("auto" | "cuda" | "triton")` or the environment variable FUSED_BACKEND choose. "auto" takes,
per op, the implementation listed in AUTO_PREFERENCE (filled from GPU benchmarks), else the CUDA C++ kernel
when it was compiled, else Triton. CPU tensors always run the C++ CPU kernels.
"""

import functools
import importlib
import os

import torch

BACKENDS = ("auto", "cuda", "triton")

# op -> "cuda" or "triton": the faster one where a GPU benchmark measured both (benchmarks/results/nvidia-h200.md,
# by the median time of an eager call, launches included): CUDA C++ for the elementwise and norm kernels; Triton
# for the cross-entropy rows (linear_cross_entropy 4096x1024x131072 bf16 forward+backward 9.0 vs 10.2 ms) and the
# log-prob rows (linear_log_probs+entropy 4096x1024x131072 fp32 forward+backward 97.0 vs 99.5 ms; 96.5 vs 99.6 in
# another run) and the distillation rows (linear_distillation_loss, same shape: 98.0 vs 104.8 ms). Ops not listed
# take CUDA C++ when it was compiled, which the linear epilogues measured faster too (linear_act 4096^3 bf16: 0.239
# vs 0.244 ms gelu, 0.232 vs 0.260 relu; FusedMLP 0.318 vs 0.349).
AUTO_PREFERENCE: dict = {
    **{op: "cuda" for op in ("bias_act", "glu", "unary_chain", "norm_fwd", "norm_backward")},
    "cross_entropy_rows": "triton",
    "log_prob_rows": "triton",
    "distillation_rows": "triton",
}

# op -> {"cuda": internal op name or None, "triton": "module:launcher" or None}; fused.info lists it.
GPU_KERNELS: dict = {}

_backend = None


def _check_backend(name):
    if name not in BACKENDS:
        raise ValueError(f"fused.set_backend: unknown backend {name!r}; expected one of {', '.join(BACKENDS)}")
    return name


def set_backend(name: str) -> None:
    """Selects the GPU implementation for every op: "auto", "cuda" (CUDA C++) or "triton"."""
    global _backend
    _backend = _check_backend(name)


def get_backend() -> str:
    if _backend is None:
        return _check_backend(os.environ.get("FUSED_BACKEND", "auto"))
    return _backend


@functools.lru_cache(None)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def cuda_kernel_compiled(internal_op: str) -> bool:
    """True when fused._C was built with CUDA and registered a CUDA kernel for fused::<internal_op>."""
    return hasattr(torch.ops.fused, internal_op) and torch._C._dispatch_has_kernel_for_dispatch_key(
        f"fused::{internal_op}", "CUDA"
    )


def choose(op: str) -> str:
    """ "cuda" or "triton": the implementation that runs `op` on a CUDA tensor now."""
    return _choice(op, get_backend())


# Cached: every GPU call of every op asks (15 us uncached on a 2-core Zen 3 host, most of it the dispatcher's
# kernel lookup); what it depends on besides the backend is fixed once fused._C and the families are imported,
# and register_gpu clears it.
@functools.lru_cache(None)
def _choice(op: str, backend: str) -> str:
    kernels = GPU_KERNELS.get(op, {})
    has_cuda = kernels.get("cuda") is not None and cuda_kernel_compiled(kernels["cuda"])
    has_triton = kernels.get("triton") is not None and triton_available()
    if backend == "auto":
        preferred = AUTO_PREFERENCE.get(op)
        if preferred == "triton" and has_triton or preferred == "cuda" and has_cuda:
            return preferred
        backend = "cuda" if has_cuda else "triton"
    if backend == "cuda" and not has_cuda:
        raise RuntimeError(
            f"fused.{op}: backend 'cuda' was asked for, but fused._C has no CUDA kernel for it "
            "(built without CUDA?); use set_backend('triton') or 'auto'"
        )
    if backend == "triton" and not has_triton:
        raise RuntimeError(f"fused.{op}: backend 'triton' was asked for, but triton is not installed")
    return backend


@functools.lru_cache(None)
def triton_launcher(path: str):
    """The launcher "package.module:function", imported on first use so that `import fused` needs no triton."""
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def gpu_router(op: str, cuda_op: str = None, triton: str = None, cuda_call=None, triton_when=None):
    """The CUDA-device kernel of fused::<op> that register_gpu registers: each call goes to the CUDA C++ op
    fused::<cuda_op> (its twin, through `cuda_call(*args)` when given, e.g. to split work the kernel cannot take
    in one launch) or to the Triton launcher at `triton` ("module:function"), per `choose(op)`; where
    `triton_when(*args)` holds and triton is installed, to Triton whatever the backend (a path only Triton
    implements). All take the op's own arguments, keyword-only ones as keywords (the dispatcher passes those
    that differ from their defaults)."""

    def cuda_kernel(*args, **kwargs):
        if triton_when is not None and triton_when(*args, **kwargs) and triton_available() or choose(op) == "triton":
            return triton_launcher(triton)(*args, **kwargs)
        return cuda_call(*args, **kwargs) if cuda_call else getattr(torch.ops.fused, cuda_op)(*args, **kwargs)

    return cuda_kernel


def register_gpu(op: str, cuda_op: str = None, triton: str = None, cuda_call=None, triton_when=None):
    """Registers fused::<op>'s CUDA-device kernel: gpu_router(...) over the CUDA C++ twin fused::<cuda_op> and the
    Triton launcher `triton` (either may be None), and lists both in GPU_KERNELS for choose() and fused.info."""
    GPU_KERNELS[op] = {"cuda": cuda_op, "triton": triton}
    _choice.cache_clear()
    torch.library.register_kernel(f"fused::{op}", "cuda", gpu_router(op, cuda_op, triton, cuda_call, triton_when))
