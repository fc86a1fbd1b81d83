#!/usr/bin/env bash
# CUDA code that does not compile cannot land, although CI has no GPU. Compile only, nothing runs, with the C++
# standard a real build against the installed torch uses (tools/torch_cxx_std.py):
#  1. every CUDA kernel source (.cu, torch-free) compiles with nvcc for sm_90 with the flags torch's CUDAExtension
#     gives every real build (its COMMON_NVCC_FLAGS: no implicit half/bfloat16 operators or conversions); ptxas
#     reports registers and spills per kernel into the log, summarised at the end;
#  2. every torch binding (*_cuda.cpp) passes g++ -fsyntax-only against the installed torch's headers and the
#     CUDA runtime headers. A CPU wheel lacks the generated c10/cuda/impl/cuda_cmake_macros.h: a stub from
#     tools/stub_include stands in for it, here only.
# Jobs run in parallel, one per core. Logs: $CUDA_CHECK_LOGS (default build/cuda-check). Exit 1 if any fails.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
logs=${CUDA_CHECK_LOGS:-build/cuda-check}
mkdir -p "$logs"
rm -f "$logs"/*.log "$logs"/*.failed
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

command -v nvcc >/dev/null || { echo "check_cuda: nvcc not found"; exit 1; }
# nvcc may be a wrapper script: ask it where its headers are.
cuda_include=$(nvcc --dryrun -x cu -c /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ INCLUDES="-I\([^"]*\)".*/\1/p' | head -1)
torch_includes=$("$PYTHON" -c 'from torch.utils.cpp_extension import include_paths; print(" ".join(include_paths()))') ||
  { echo "check_cuda: cannot import torch with $PYTHON"; exit 1; }
# The C++ standard a real build gets: the one torch's BuildExtension adds (setup.py names none).
cxx_std=$("$PYTHON" tools/torch_cxx_std.py) || { echo "check_cuda: cannot tell torch's C++ standard"; exit 1; }
read -r -a torch_nvcc_flags < <("$PYTHON" -c 'from torch.utils.cpp_extension import COMMON_NVCC_FLAGS as f; print(" ".join(f))')
[ ${#torch_nvcc_flags[@]} -gt 0 ] || { echo "check_cuda: cannot read torch's COMMON_NVCC_FLAGS"; exit 1; }
[ -n "$cuda_include" ] && [ -f "$cuda_include/cuda_runtime.h" ] || { echo "check_cuda: no cuda_runtime.h ($cuda_include)"; exit 1; }

gxx_flags=(-std="$cxx_std" -fsyntax-only -Wall -DFUSED_WITH_CUDA=1 -Icsrc)
read -r -a torch_dirs <<<"$torch_includes"
[ -f "${torch_dirs[0]}/c10/cuda/impl/cuda_cmake_macros.h" ] || gxx_flags+=(-Itools/stub_include)
for d in "${torch_dirs[@]}"; do gxx_flags+=(-isystem "$d"); done
gxx_flags+=(-isystem "$cuda_include")

max_jobs=$(nproc 2>/dev/null || echo 2)
# run NAME CMD...: in the background (at most max_jobs at once), output to $logs/NAME.log, NAME.failed on error.
run() {
  local name=$1
  shift
  while [ "$(jobs -rp | wc -l)" -ge "$max_jobs" ]; do wait -n; done
  (
    if "$@" >"$logs/$name.log" 2>&1; then
      echo "ok      $name"
    else
      touch "$logs/$name.failed"
      echo "FAILED  $name: $*"
      cat "$logs/$name.log"
    fi
  ) &
}

mapfile -t kernels < <(find csrc -name '*.cu' | sort)
mapfile -t bindings < <(find csrc -name '*_cuda.cpp' | sort)
for f in "${kernels[@]}"; do
  run "nvcc-$(basename "$f")" nvcc -std="$cxx_std" -O3 -arch=sm_90 "${torch_nvcc_flags[@]}" -Icsrc -Xptxas -v \
    -c "$f" -o "$out/$(basename "$f").o"
done
for f in "${bindings[@]}"; do
  run "g++-$(basename "$f")" g++ "${gxx_flags[@]}" "$f"
done
wait

# Registers and spills per .cu, from ptxas -v.
for f in "${kernels[@]}"; do
  log="$logs/nvcc-$(basename "$f").log"
  [ -f "$log" ] && [ ! -f "${log%.log}.failed" ] && awk -v file="$f" '
    /Used [0-9]+ registers/ { n++; for (i = 1; i <= NF; i++) if ($(i + 1) == "registers,") r = $i; if (r > max) max = r }
    /bytes spill stores/ { if ($5 > 0) { spills++; if ($5 > maxs) maxs = $5 } }
    END { printf "ptxas   %s: %d kernels, at most %d registers, %d with spills (at most %d bytes)\n",
                 file, n, max, spills, maxs }' "$log"
done

failed=$(find "$logs" -name '*.failed' | wc -l)
echo "check_cuda: ${#kernels[@]} .cu through nvcc (sm_90), ${#bindings[@]} *_cuda.cpp through g++ -fsyntax-only" \
  "(-std=$cxx_std); logs in $logs"
if [ "$failed" -gt 0 ]; then
  echo "check_cuda: FAILED ($failed of $((${#kernels[@]} + ${#bindings[@]})))"
  exit 1
fi
