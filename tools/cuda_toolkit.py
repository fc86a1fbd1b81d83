"""Where the CUDA toolkit behind `nvcc` on PATH lives, as nvcc itself reports it.

torch guesses CUDA_HOME as the parent of nvcc's folder. Where `nvcc` is a wrapper script (e.g. /usr/local/bin/nvcc
that execs the real compiler) that folder has no cuda_runtime.h and the build fails; nvcc's `--dryrun` names the
real toolkit (TOP). Used by setup.py before torch.utils.cpp_extension is imported, and by tools/*.sh:
`python3 tools/cuda_toolkit.py` prints the folder (nothing, exit 1, when there is none).
"""

import os
import shutil
import subprocess
import sys


def real_cuda_home(nvcc=None):
    nvcc = nvcc or shutil.which("nvcc")
    if nvcc is None:
        return None
    try:
        out = subprocess.run(
            [nvcc, "--dryrun", "-x", "cu", "-c", os.devnull, "-o", os.devnull],
            capture_output=True,
            text=True,
            timeout=60,
        ).stderr
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        if line.startswith("#$ TOP="):
            top = os.path.realpath(line.split("=", 1)[1].strip())
            if os.path.isfile(os.path.join(top, "include", "cuda_runtime.h")):
                return top
    return None


if __name__ == "__main__":
    home = real_cuda_home()
    if home is None:
        sys.exit(1)
    print(home)
