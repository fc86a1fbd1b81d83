"""The build's own helpers: what a user's `pip install` and the GPU suite rely on before any kernel runs."""

import glob
import importlib.util
import os
import re
import shutil
import stat
import subprocess
import sys
import tarfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cuda_toolkit():
    spec = importlib.util.spec_from_file_location("cuda_toolkit", os.path.join(ROOT, "tools", "cuda_toolkit.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc on PATH")
def test_cuda_home_found_through_an_nvcc_wrapper_script(tmp_path):
    """A wrapper `nvcc` in a folder with no toolkit beside it: the toolkit is the one the real nvcc reports, with
    cuda_runtime.h, not the wrapper's parent folder that torch would guess."""
    real = shutil.which("nvcc")
    wrapper_dir = tmp_path / "bin"
    wrapper_dir.mkdir()
    wrapper = wrapper_dir / "nvcc"
    wrapper.write_text(f'#!/bin/sh\nexec "{real}" "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    home = cuda_toolkit().real_cuda_home(str(wrapper))
    assert home is not None and not home.startswith(str(tmp_path))
    assert os.path.isfile(os.path.join(home, "include", "cuda_runtime.h"))
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "cuda_toolkit.py")],
        capture_output=True,
        text=True,
        env={**os.environ, "PATH": f"{wrapper_dir}:{os.environ['PATH']}"},
    )
    assert out.returncode == 0 and out.stdout.strip() == home


def test_no_cuda_home_without_a_working_nvcc(tmp_path):
    fake = tmp_path / "nvcc"
    fake.write_text("#!/bin/sh\necho 'nvcc: not a toolkit' >&2\nexit 1\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    assert cuda_toolkit().real_cuda_home(str(fake)) is None
    assert cuda_toolkit().real_cuda_home(str(tmp_path / "missing")) is None


def load_setup():
    """setup.py as a module (setup() runs only as __main__): its CPU_ARCHES table and cpu_arch()."""
    spec = importlib.util.spec_from_file_location("fused_setup", os.path.join(ROOT, "setup.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_setup(tmp_path, env=None, pythonpath=None):
    """python setup.py --name from the repository root, as pip's first call runs it."""
    env = {**os.environ, **(env or {})}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    return subprocess.run(
        [sys.executable, "setup.py", "--name"], cwd=ROOT, capture_output=True, text=True, env=env, timeout=300
    )


def test_cpu_arch_names_the_isa_and_sets_flags_and_define_together(monkeypatch):
    """FUSED_CPU_ARCH is avx512, avx2 or default; each sets at::vec's CPU_CAPABILITY_<ISA> with its -m flags, and
    auto-detection takes the widest the machine has from the same table."""
    setup = load_setup()
    assert list(setup.CPU_ARCHES) == ["avx512", "avx2", "default"]
    for name, (_, flags) in setup.CPU_ARCHES.items():
        defines = [f for f in flags if f.startswith("-DCPU_CAPABILITY_")]
        assert defines == [f"-DCPU_CAPABILITY_{name.upper()}"] and f"-DCPU_CAPABILITY={name.upper()}" in flags
        assert any(f.startswith("-m") for f in flags) == (name != "default")
        assert not any(f.startswith("-march") for f in flags)
    for name in setup.CPU_ARCHES:
        monkeypatch.setenv("FUSED_CPU_ARCH", name)
        assert setup.cpu_arch() == name
    monkeypatch.delenv("FUSED_CPU_ARCH")
    with open("/proc/cpuinfo") as f:
        cpu_flags = set(f.read().split())
    widest = next(name for name, (needs, _) in setup.CPU_ARCHES.items() if needs <= cpu_flags)
    assert setup.cpu_arch() == widest


def test_unknown_cpu_arch_stops_the_build_with_one_line(tmp_path):
    out = run_setup(tmp_path, env={"FUSED_CPU_ARCH": "skylake"})
    assert out.returncode == 1
    # ours is the one line after whatever torch logs on import (a CUDA torch on a machine without a GPU warns)
    ours = [line for line in out.stderr.strip().splitlines() if "torch/utils/cpp_extension.py" not in line]
    assert ours == ["fused: FUSED_CPU_ARCH=skylake is not one of avx512, avx2, default"]


def test_build_without_torch_stops_with_one_line(tmp_path):
    """What pip's build isolation gives setup.py: no torch. One line saying what to run, no traceback."""
    shadow = tmp_path / "torch"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise ImportError('No module named torch')\n")
    out = run_setup(tmp_path, pythonpath=str(tmp_path))
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        "fused: building needs the installed torch: run `pip install --no-build-isolation .` (torch first)"
    ]


def test_build_requirements_leave_torch_out():
    """[build-system].requires with torch makes pip fetch the newest torch (gigabytes) into the isolated build
    and build against a torch other than the installed one."""
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        requires = re.search(r"\[build-system\]\s*requires\s*=\s*\[([^\]]*)\]", f.read()).group(1)
    names = [re.match(r"\s*[\"']([A-Za-z0-9_.-]+)", r).group(1).lower() for r in requires.split(",") if r.strip()]
    assert "setuptools" in names and "torch" not in names


def test_cxx_standard_follows_torch():
    """setup.py names no -std (torch's BuildExtension adds its own); the compile checks take torch's."""
    with open(os.path.join(ROOT, "setup.py")) as f:
        assert "-std=" not in f.read()
    spec = importlib.util.spec_from_file_location("torch_cxx_std", os.path.join(ROOT, "tools", "torch_cxx_std.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert [module.std_for_version(v) for v in ("2.11.0", "2.13.0+cpu", "2.14.1", "2.15.0", "3.0")] == [
        "c++17",
        "c++17",
        "c++20",
        "c++20",
        "c++20",
    ]
    assert module.installed_torch_std() in ("c++17", "c++20")


def test_source_distribution_carries_everything_the_build_reads(tmp_path):
    """`pip install fused-<version>.tar.gz` compiles csrc/ on the user's machine: every header, .cu and binding file
    must be in the sdist (setuptools packs only the sources the extension lists on the packing machine)."""
    out = subprocess.run(
        [sys.executable, "setup.py", "-q", "egg_info", "--egg-base", str(tmp_path), "sdist", "-d", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    (archive,) = tmp_path.glob("fused-*.tar.gz")
    with tarfile.open(archive) as tar:
        packed = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    needed = ["setup.py", "pyproject.toml", os.path.join("tools", "cuda_toolkit.py")]
    for folder, _, files in os.walk(os.path.join(ROOT, "csrc")):
        needed += [
            os.path.relpath(os.path.join(folder, f), ROOT) for f in files if f.endswith((".h", ".cuh", ".cu", ".cpp"))
        ]
    needed += [os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "fused", "**", "*.py"), recursive=True)]
    missing = sorted(set(needed) - packed)
    assert not missing, f"missing from the sdist: {missing}"
