import os
import sys

import torch

# Triton kernels run on CPU tensors under the interpreter where no GPU is present; this must be set before
# any @triton.jit kernel is defined (the launchers are imported lazily, after this).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pytest  # noqa: E402

try:  # Hypothesis draws the same examples on every run (a CI failure reproduces anywhere);
    # HYPOTHESIS_PROFILE=explore draws fresh ones. (A GPU machine without hypothesis still runs the rest.)
    from hypothesis import settings
except ImportError:
    settings = None
if settings is not None:
    settings.register_profile("fixed", derandomize=True, print_blob=True)
    settings.register_profile("explore", print_blob=True)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "fixed"))

from tests.harness import backend, device_backends  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1":  # the same-bits checks need tl.fma rounded once, as on a GPU
    from tests.triton_interpreter import exact_fma_in_interpreter

    exact_fma_in_interpreter()


@pytest.fixture(params=device_backends())
def dev(request):
    """The device to test on, with the GPU backend selected: "cpu", then "cuda" once per GPU backend."""
    device, name = request.param
    with backend(name):
        yield device


@pytest.fixture(scope="module")
def emu():
    """The host emulation of the CUDA kernels (tests/cuda_emulation.py), one simulated SM, a fixed schedule."""
    from tests import cuda_emulation

    m = cuda_emulation.module()
    m.set_sm_count(1)
    m.set_schedule_seed(1)
    yield m
    m.set_sm_count(2)


@pytest.fixture
def one_thread():
    """Small matrices: more threads only add contention on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(params=["float32", "int8"], ids=["f32_filter", "int8_filter"])
def knn_filter(request, monkeypatch):
    """The CPU k-NN GEMM filter (p = 2, D >= 32): float32, or int8 codes then float32 for the columns that pass.
    The CPU picks one by itself (int8 where torch's int8 GEMM is exact, from 128 rows of a); FUSED_KNN_FILTER
    forces either, so both run here."""
    import fused

    if request.param == "int8" and fused._C.int8_gemm_levels() == 0:
        pytest.skip("torch's int8 GEMM is not exact on this CPU: the int8 filter never runs here")
    monkeypatch.setenv("FUSED_KNN_FILTER", request.param)
    return request.param
