"""Builds fused._C: CPU C++ kernels always; CUDA C++ kernels when torch has CUDA and nvcc exists.

Environment:
  FUSED_NO_CUDA=1        CPU-only build even where CUDA is available
  DEBUG=1                -O0 -g
  TORCH_CUDA_ARCH_LIST   GPU architectures (default "8.0;9.0")
  FUSED_CPU_ARCH         the CPU kernels' vector ISA: avx512, avx2 or default (at::vec's scalar code); unset: the
                         widest of them the build machine has
The C++ standard is torch's: torch.utils.cpp_extension adds the -std its headers need (c++20 in torch 2.13 to 2.15).
"""

import glob
import importlib.util
import os
import shutil
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def real_cuda_home():
    path = os.path.join(ROOT, "tools", "cuda_toolkit.py")
    if not os.path.isfile(path):
        return None
    spec = importlib.util.spec_from_file_location("cuda_toolkit", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.real_cuda_home()


# Must be set before torch.utils.cpp_extension is imported: it reads CUDA_HOME once, at import.
if not os.environ.get("CUDA_HOME") and not os.environ.get("CUDA_PATH"):
    _home = real_cuda_home()
    if _home:
        os.environ["CUDA_HOME"] = _home

try:
    import torch  # noqa: E402
except ImportError:
    # pip's build isolation hides the installed torch; [build-system].requires leaves torch out on purpose (it would
    # fetch the newest torch, gigabytes, and build against a torch other than the one the extension runs with).
    sys.exit("fused: building needs the installed torch: run `pip install --no-build-isolation .` (torch first)")
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension  # noqa: E402

DEBUG = os.environ.get("DEBUG", "0") == "1"


def cuda_wanted():
    if os.environ.get("FUSED_NO_CUDA", "0") == "1":
        return False
    has_nvcc = CUDA_HOME is not None or shutil.which("nvcc") is not None
    return torch.version.cuda is not None and has_nvcc


# FUSED_CPU_ARCH -> (the /proc/cpuinfo flags the ISA needs, compiler flags). at::vec picks its implementation from
# CPU_CAPABILITY_<ISA>; the -m flags must agree, so each ISA sets both. Widest first: auto-detection takes the first
# the build machine has (pip builds on the machine that runs the kernels, as torch's own kernels pick at run time).
CPU_ARCHES = {
    "avx512": (
        {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "f16c"},
        ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"]
        + ["-DCPU_CAPABILITY_AVX512", "-DCPU_CAPABILITY=AVX512"],
    ),
    "avx2": ({"avx2", "fma", "f16c"}, ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2"]),
    "default": (set(), ["-DCPU_CAPABILITY_DEFAULT", "-DCPU_CAPABILITY=DEFAULT"]),
}


def cpu_arch():
    arch = os.environ.get("FUSED_CPU_ARCH")
    if arch:
        if arch not in CPU_ARCHES:
            sys.exit(f"fused: FUSED_CPU_ARCH={arch} is not one of {', '.join(CPU_ARCHES)}")
        return arch
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(f.read().split())
    except OSError:
        flags = set()
    return next(name for name, (needs, _) in CPU_ARCHES.items() if needs <= flags)


def sources(pattern):
    return sorted(glob.glob(os.path.join("csrc", "**", pattern), recursive=True))


def extension():
    opt = ["-O0", "-g"] if DEBUG else ["-O3"]
    # No -std: torch's BuildExtension adds the standard its headers need, to cxx and nvcc alike.
    cxx = opt + ["-fopenmp"] + CPU_ARCHES[cpu_arch()][1]
    # Binding files that touch torch's CUDA headers end in _cuda.cpp; kernels are torch-free .cu files.
    cpu_sources = [s for s in sources("*.cpp") if not s.endswith("_cuda.cpp")]
    if cuda_wanted():
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
        nvcc = opt + ["-lineinfo", "--expt-relaxed-constexpr"]
        return CUDAExtension(
            "fused._C",
            cpu_sources + sources("*_cuda.cpp") + sources("*.cu"),
            include_dirs=[os.path.join(ROOT, "csrc")],
            define_macros=[("FUSED_WITH_CUDA", "1")],
            extra_compile_args={"cxx": cxx, "nvcc": nvcc},
            extra_link_args=["-fopenmp"],
        )
    return CppExtension(
        "fused._C",
        cpu_sources,
        include_dirs=[os.path.join(ROOT, "csrc")],
        define_macros=[],
        extra_compile_args={"cxx": cxx},
        extra_link_args=["-fopenmp"],
    )


# Run by pip and `python setup.py` as __main__; tools/check_torch_headers.py and tests load it for CPU_ARCHES.
if __name__ == "__main__":
    setup(
        name="fused",
        version="0.1.0",
        packages=find_packages(include=["fused", "fused.*"]),
        ext_modules=[extension()],
        cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    )
