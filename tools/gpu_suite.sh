#!/usr/bin/env bash
# The one call for a lent GPU machine (torch with CUDA, triton, nvcc, ninja, no network):
#   install   pip install --no-build-isolation --no-deps -e .  (CUDA kernels built for TORCH_CUDA_ARCH_LIST, default 9.0)
#   cuda      the whole pytest suite with FUSED_BACKEND=cuda
#   triton    the whole pytest suite with FUSED_BACKEND=triton
#   sanitize  compute-sanitizer over the CUDA C++ tests: memcheck over all, racecheck and synccheck over the kernels
#             with shared memory and barriers (bias-gradient reductions, norm rows, cross-entropy rows, grad norm)
#   bench     python -m benchmarks.run --device cuda --out $OUT/bench
# Usage: OUT=dir bash tools/gpu_suite.sh [stage ...]   (default: every stage, in that order)
# Device plan (10 minutes a command, 30 of device time a session), logs under $OUT so a timeout still returns them:
#   1. OUT=$OUT bash tools/gpu_suite.sh install cuda
#   2. OUT=$OUT bash tools/gpu_suite.sh triton sanitize
#   3. OUT=$OUT bash tools/gpu_suite.sh bench
# A machine given back between calls comes back bare: any stage after `install` builds first when fused._C with
# its CUDA kernels does not import.
# Every stage runs even when an earlier one failed; each gets at most what is left of SUITE_BUDGET_S (default 570 s,
# under the device's 10-minute command limit). Writes at most 8 files: $OUT/{install,pytest_cuda,pytest_triton,
# sanitizer,bench}.log and $OUT/bench/*. Prints a summary last; exits 1 if any stage failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
# The interpreter that holds torch: python3 on the device machine (where `python` may be absent or another one).
if [ -z "${PYTHON:-}" ]; then
  for candidate in python3 python; do
    if command -v "$candidate" >/dev/null && "$candidate" -c "import torch" 2>/dev/null; then PYTHON=$candidate; break; fi
  done
fi
PYTHON=${PYTHON:-python3}
# setup.py finds the toolkit behind a wrapper nvcc itself; the sanitizer lives in that toolkit's bin/.
cuda_home=${CUDA_HOME:-$("$PYTHON" tools/cuda_toolkit.py 2>/dev/null)}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
budget=${SUITE_BUDGET_S:-570}
start=$SECONDS
stages=("$@")
[ ${#stages[@]} -gt 0 ] || stages=(install cuda triton sanitize bench)
summary=()

# stage NAME LOG CAP CMD...: runs CMD with output to LOG, for at most CAP seconds or what is left of the budget.
stage() {
  local name=$1 log=$2 cap=$3
  shift 3
  local left=$((budget - (SECONDS - start)))
  [ "$cap" -lt "$left" ] || cap=$left
  if [ "$cap" -le 5 ]; then
    summary+=("FAILED  $name: not run, suite budget spent")
    return
  fi
  local t0=$SECONDS rc
  echo "== $name (limit ${cap}s): $*" | tee -a "$log"
  timeout --kill-after=10 "$cap" "$@" >>"$log" 2>&1
  rc=$?
  local detail
  detail=$(grep -E "^(=+ )?[0-9]+ (passed|failed)|[0-9]+ (passed|failed|error)|ERROR SUMMARY" "$log" | tail -2 | tr '\n' ' ')
  if [ $rc -eq 0 ]; then
    summary+=("ok      $name ($((SECONDS - t0))s) $detail")
  elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    summary+=("FAILED  $name: timed out after ${cap}s $detail (log: $log)")
  else
    summary+=("FAILED  $name: exit $rc $detail (log: $log)")
  fi
}

sanitizer=$(command -v compute-sanitizer || ls "$cuda_home/bin/compute-sanitizer" "$cuda_home/compute-sanitizer/compute-sanitizer" \
  /usr/local/cuda/bin/compute-sanitizer 2>/dev/null | head -1)
pytest=("$PYTHON" -m pytest -p no:cacheprovider -q -rfE --maxfail=100)

# Stages that need the build, on a machine that has none yet (a fresh one, or a call after the machine went back).
needs_build() {
  case " ${stages[*]} " in *" install "*) return 1 ;; esac
  ! "$PYTHON" -c "import torch, fused; assert torch.cuda.is_available() and hasattr(torch.ops.fused, 'cuda_bias_act')" \
    2>/dev/null
}
if needs_build; then stages=(install "${stages[@]}"); fi

for s in "${stages[@]}"; do
  case $s in
    install)
      rm -f "$OUT/install.log"
      stage install "$OUT/install.log" 400 "$PYTHON" -m pip install --no-build-isolation --no-deps -v -e .
      stage import "$OUT/install.log" 60 "$PYTHON" -c "
import torch, fused
from fused._backend import GPU_KERNELS, cuda_kernel_compiled
assert torch.cuda.is_available(), 'no CUDA device'
missing = [op for op, k in GPU_KERNELS.items() if k['cuda'] and not cuda_kernel_compiled(k['cuda'])]
print(torch.__version__, torch.cuda.get_device_name(), 'CUDA kernels missing:', missing)
assert not missing" ;;
    cuda)
      rm -f "$OUT/pytest_cuda.log"
      stage "pytest cuda" "$OUT/pytest_cuda.log" 240 env FUSED_BACKEND=cuda "${pytest[@]}" tests ;;
    triton)
      rm -f "$OUT/pytest_triton.log"
      stage "pytest triton" "$OUT/pytest_triton.log" 240 env FUSED_BACKEND=triton "${pytest[@]}" tests ;;
    sanitize)
      rm -f "$OUT/sanitizer.log"
      if [ -z "$sanitizer" ]; then
        summary+=("FAILED  sanitize: compute-sanitizer not found")
        continue
      fi
      # Without the caching allocator every tensor is its own allocation, so memcheck sees out-of-bounds accesses.
      stage memcheck "$OUT/sanitizer.log" 200 env FUSED_BACKEND=cuda PYTORCH_NO_CUDA_MEMORY_CACHING=1 \
        "$sanitizer" --tool memcheck --target-processes all --error-exitcode 86 --print-limit 20 \
        "${pytest[@]}" tests -k "cuda and not triton and not compile and not opcheck"
      # Shared memory and barriers: the bias-gradient reductions (bias_act, dropout backward), the norm and
      # cross-entropy row kernels (block reductions) and the optimizer's grad norm (last-block finish).
      shared="(bias_act or dropout or norm or cross_entropy or clip or grad_norm)"
      for tool in racecheck synccheck; do
        stage $tool "$OUT/sanitizer.log" 120 env FUSED_BACKEND=cuda \
          "$sanitizer" --tool $tool --target-processes all --error-exitcode 86 --print-limit 20 \
          "${pytest[@]}" tests -k "cuda and not triton and not compile and not opcheck and $shared"
      done ;;
    bench)
      rm -f "$OUT/bench.log"
      stage bench "$OUT/bench.log" 300 "$PYTHON" -m benchmarks.run --device cuda --out "$OUT/bench" ;;
    *)
      summary+=("FAILED  $s: unknown stage (expected install cuda triton sanitize bench)") ;;
  esac
done

echo
echo "== gpu_suite summary ($((SECONDS - start))s; logs under $OUT)"
"$PYTHON" -c "import torch; print('device:', torch.cuda.get_device_name() if torch.cuda.is_available() else 'none')" 2>/dev/null
failed=0
for line in "${summary[@]}"; do
  echo "$line"
  [[ $line == FAILED* ]] && failed=1
done
exit $failed
