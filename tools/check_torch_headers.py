"""Every C++ source in csrc/ through g++ -fsyntax-only against another torch's headers (default: the newest, 2.15,
whose ATen.h wants C++20 as 2.14's does), so the sources keep building against the newest torch, not only the
installed one.

The headers come from the torch wheel pip can get (pip download --no-deps: the wheel alone, no CUDA packages),
unpacked once, include/ only, into ~/.cache/fused/torch-headers/<version>; later runs use that copy. Where no such
wheel can be had (no network, no index that has it), one line says so and the check passes. The CPU sources are
checked with the AVX-512 flags of setup.py's CPU_ARCHES (at::vec's widest code); the CUDA bindings (*_cuda.cpp)
too where nvcc names a toolkit, with tools/check_cuda.sh's stub for a CPU wheel's missing CUDA header.

  python tools/check_torch_headers.py ["torch==2.15.*,torch==2.14.*"]   (FUSED_TORCH_HEADERS sets the default: the
  first of these whose wheel pip can get)
"""

import concurrent.futures
import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import zipfile

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "fused", "torch-headers")


def load_tool(name, path):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cached_headers(requirement):
    """The newest cached version the requirement allows: (version, include folder), or None."""
    versions = [v for v in os.listdir(CACHE) if requirement.specifier.contains(v)] if os.path.isdir(CACHE) else []
    if not versions:
        return None
    version = max(versions, key=Version)
    return version, os.path.join(CACHE, version, "include")


def download_headers(requirement):
    """pip download of the wheel, its torch/include unpacked into the cache; None (and why) when pip cannot."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", tmp]
        got = subprocess.run(cmd + [str(requirement)], capture_output=True, text=True)
        wheels = glob.glob(os.path.join(tmp, "torch-*.whl"))
        if got.returncode != 0 or not wheels:
            return None, (got.stderr.strip().splitlines() or ["no wheel"])[-1]
        version = re.match(r"torch-([^-+]+)", os.path.basename(wheels[0])).group(1)
        staging = os.path.join(CACHE, f".{version}.partial")
        shutil.rmtree(staging, ignore_errors=True)
        with zipfile.ZipFile(wheels[0]) as wheel:
            wheel.extractall(staging, [n for n in wheel.namelist() if n.startswith("torch/include/")])
        os.makedirs(os.path.join(CACHE, version), exist_ok=True)
        shutil.rmtree(os.path.join(CACHE, version, "include"), ignore_errors=True)
        os.rename(os.path.join(staging, "torch", "include"), os.path.join(CACHE, version, "include"))
        shutil.rmtree(staging)
    return (version, os.path.join(CACHE, version, "include")), None


def compile_commands(version, include):
    cxx_std = load_tool("torch_cxx_std", "tools/torch_cxx_std.py").std_for_version(version)
    arch = load_tool("fused_setup", "setup.py").CPU_ARCHES["avx512"][1]
    base = ["g++", f"-std={cxx_std}", "-fsyntax-only", "-Wall", "-fopenmp", "-Icsrc"]
    base += ["-isystem", include, "-isystem", os.path.join(include, "torch", "csrc", "api", "include")]
    base += [
        "-isystem",
        sysconfig.get_paths()["include"],
        "-DTORCH_API_INCLUDE_EXTENSION_H",
        "-DTORCH_EXTENSION_NAME=_C",
    ]
    sources = sorted(glob.glob("csrc/**/*.cpp", recursive=True))
    commands = {s: base + arch + [s] for s in sources if not s.endswith("_cuda.cpp")}
    cuda_home = load_tool("cuda_toolkit", "tools/cuda_toolkit.py").real_cuda_home()
    if cuda_home:
        cuda = base + ["-DFUSED_WITH_CUDA=1", "-isystem", os.path.join(cuda_home, "include")]
        if not os.path.isfile(os.path.join(include, "c10", "cuda", "impl", "cuda_cmake_macros.h")):
            cuda += ["-Itools/stub_include"]
        commands.update({s: cuda + [s] for s in sources if s.endswith("_cuda.cpp")})
    return cxx_std, commands


# Newest first; the next is taken where pip cannot get one (a machine's pip constraints may cap torch below it).
DEFAULT_REQUIREMENTS = "torch==2.15.*,torch==2.14.*"


def find_headers(requirements):
    """(version, include folder) of the first requirement whose headers are cached or downloadable, else None."""
    for requirement in requirements:
        found = cached_headers(requirement)
        if found is None:
            found, why = download_headers(requirement)
        if found is not None:
            return found
        print(f"check_torch_headers: no {requirement} wheel to take headers from ({why})")
    return None


def main():
    spec = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("FUSED_TORCH_HEADERS", DEFAULT_REQUIREMENTS)
    requirements = [Requirement(r.strip()) for r in re.split(r",(?=\s*torch)", spec)]
    os.chdir(ROOT)
    found = find_headers(requirements)
    if found is None:
        print("check_torch_headers: skipped")
        return 0
    version, include = found
    cxx_std, commands = compile_commands(version, include)
    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 2) as pool:
        results = dict(
            zip(commands, pool.map(lambda c: subprocess.run(c, capture_output=True, text=True), commands.values()))
        )
    failed = [s for s, r in results.items() if r.returncode != 0]
    for s in failed:
        print(f"FAILED  {s}: {' '.join(commands[s])}\n{results[s].stderr[-4000:]}")
    print(
        f"check_torch_headers: {len(commands) - len(failed)} of {len(commands)} csrc/*.cpp compile against torch "
        f"{version}'s headers (-std={cxx_std}, g++ -fsyntax-only; {include})"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
