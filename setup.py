"""Builds fused._C: CPU C++ kernels always; CUDA C++ kernels when torch has CUDA and nvcc exists.

Environment:
  FUSED_NO_CUDA=1        CPU-only build even where CUDA is available
  DEBUG=1                -O0 -g
  TORCH_CUDA_ARCH_LIST   GPU architectures (default "8.0;9.0")
  FUSED_CPU_ARCH         -march value for the CPU kernels (default: AVX-512 or AVX2 when the build machine has it)
"""

import glob
import importlib.util
import os
import shutil

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

import torch  # noqa: E402
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension  # noqa: E402

DEBUG = os.environ.get("DEBUG", "0") == "1"


def cuda_wanted():
    if os.environ.get("FUSED_NO_CUDA", "0") == "1":
        return False
    has_nvcc = CUDA_HOME is not None or shutil.which("nvcc") is not None
    return torch.version.cuda is not None and has_nvcc


def cpu_arch_flags():
    arch = os.environ.get("FUSED_CPU_ARCH")
    if arch:
        return [f"-march={arch}"]
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return []
    # at::vec picks its implementation from CPU_CAPABILITY_<ISA>; the -m flags must agree. pip builds on the
    # machine that runs the kernels, so the widest ISA it has is the one torch's own kernels use too.
    flags = set(info.split())
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma"} <= flags:
        return [
            "-mavx512f",
            "-mavx512bw",
            "-mavx512vl",
            "-mavx512dq",
            "-mfma",
            "-mf16c",
            "-DCPU_CAPABILITY_AVX512",
            "-DCPU_CAPABILITY=AVX512",
        ]
    if {"avx2", "fma"} <= flags:
        return ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2"]
    return []


def sources(pattern):
    return sorted(glob.glob(os.path.join("csrc", "**", pattern), recursive=True))


def extension():
    opt = ["-O0", "-g"] if DEBUG else ["-O3"]
    cxx = opt + ["-std=c++17", "-fopenmp"] + cpu_arch_flags()
    # Binding files that touch torch's CUDA headers end in _cuda.cpp; kernels are torch-free .cu files.
    cpu_sources = [s for s in sources("*.cpp") if not s.endswith("_cuda.cpp")]
    if cuda_wanted():
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
        nvcc = opt + ["-std=c++17", "-lineinfo", "--expt-relaxed-constexpr"]
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


setup(
    name="fused",
    version="0.1.0",
    packages=find_packages(include=["fused", "fused.*"]),
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
