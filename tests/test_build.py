"""The build's own helpers: what a user's `pip install` and the GPU suite rely on before any kernel runs."""

import importlib.util
import os
import shutil
import stat
import subprocess
import sys

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
