#!/usr/bin/env bash
# The one call for a lent GPU machine (torch with CUDA, triton, nvcc, ninja, no network), sized for one command of
# under 10 minutes (SUITE_BUDGET_S, default 570 s):
#   1. install   pip install --no-build-isolation --no-deps -e .  (CUDA kernels for TORCH_CUDA_ARCH_LIST, default 9.0)
#   2. at once, side by side:
#      pytest    the parity suite's GPU tests, both backends: the `dev` fixture gives every family's tests the ids
#                cuda-cuda and cuda-triton (FUSED_TEST_CPU=0 drops its cpu id), and -k "(cuda or triton) and not
#                emulation" (PYTEST_K) keeps the GPU-only tests; pytest-xdist spreads them over the cores. CI runs the
#                CPU tests.
#      sanitize  compute-sanitizer over the CUDA C++ tests (ids cuda-cuda and the test_optim_cuda file), one process
#                per family: memcheck for each; racecheck and synccheck for the kernels with shared memory and
#                barriers (norm rows, cross-entropy rows, bias-gradient reductions, the optimizer's grad norm);
#                initcheck (reads of memory nothing wrote: workspaces, partial sums) over every family;
#                SANITIZE_ONLY (a regex over "tool|files|filter") runs a subset
#      diag      tools/gpu_diag.sh: the toolchain, and the C++ argument-error probes (diag.log)
#   3. bench     tools/host_overhead.py (host time per eager call, per backend), tools/gpu_kernel_times.py (device
#                time per kernel of the cases behind their targets), then python -m benchmarks.run
#                --device cuda (the GPU to itself; the device's copy bandwidth measured first; BENCH_S seconds kept
#                for both, BENCH_ARGS passed on; BENCH_FIRST=1 runs them before step 2)
# Usage: OUT=dir bash tools/gpu_suite.sh   (SUITE_TESTS: the pytest paths, default tests). Logs and figures under
# $OUT (at most 8 files come back): install.log, pytest.log, sanitizer.log (every sanitizer process's summary, then
# its log), diag.log, bench.log, bench/*. Prints a summary last; exits 1 if any stage failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
# Everything but the 8 files that come back lives outside $OUT: stage summaries, each sanitizer process's log.
WORK=$(mktemp -d)
export DIAG_WORK=$WORK
if [ -z "${PYTHON:-}" ]; then  # the interpreter that holds torch: python3 on the device machine
  for candidate in python3 python; do
    if command -v "$candidate" >/dev/null && "$candidate" -c "import torch" 2>/dev/null; then PYTHON=$candidate; break; fi
  done
fi
PYTHON=${PYTHON:-python3}
cuda_home=${CUDA_HOME:-$("$PYTHON" tools/cuda_toolkit.py 2>/dev/null)}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
export PYTHONUNBUFFERED=1
budget=${SUITE_BUDGET_S:-570}
bench_min=${BENCH_S:-170}  # seconds kept for the benchmarks at the end
start=$SECONDS
left() { echo $((budget - (SECONDS - start))); }
summary=()

# run NAME LOG CAP CMD...: CMD with output to LOG for at most CAP seconds; appends a summary line.
run() {
  local name=$1 log=$2 cap=$3
  shift 3
  local t0=$SECONDS rc detail
  if [ "$cap" -lt 5 ]; then
    echo "FAILED  $name: no time left in the budget" >>"$WORK/$(basename "$log").summary"
    return
  fi
  echo "== $name (limit ${cap}s): $*" >>"$log"
  # SIGINT first: pytest then stops as on Ctrl-C and still prints its failures' tracebacks and summary
  timeout -s INT --kill-after=10 "$cap" "$@" >>"$log" 2>&1
  rc=$?
  detail=$(grep -aE "[0-9]+ (passed|failed|error)|ERROR SUMMARY|RACECHECK SUMMARY" "$log" | tail -2 | tr '\n' ' ')
  if [ $rc -eq 0 ]; then
    echo "ok      $name ($((SECONDS - t0))s) $detail" >>"$WORK/$(basename "$log").summary"
  elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    echo "FAILED  $name: timed out after ${cap}s $detail" >>"$WORK/$(basename "$log").summary"
  else
    echo "FAILED  $name: exit $rc $detail" >>"$WORK/$(basename "$log").summary"
  fi
}

# 1. install
rm -rf "${OUT:?}"/*
run install "$OUT/install.log" 260 "$PYTHON" -m pip install --no-build-isolation --no-deps -v -e .
run import "$OUT/install.log" 60 "$PYTHON" -c "
import torch, fused, triton
from fused._backend import GPU_KERNELS, cuda_kernel_compiled
assert torch.cuda.is_available(), 'no CUDA device'
missing = [op for op, k in GPU_KERNELS.items() if k['cuda'] and not cuda_kernel_compiled(k['cuda'])]
p = torch.cuda.get_device_properties(0)
print(torch.__version__, triton.__version__, p.name, p.multi_processor_count, 'SMs; CUDA kernels missing:', missing)
assert not missing"
cat "$WORK/install.log.summary"

# bench LIMIT: the benchmarks (BENCH_ARGS) for at most LIMIT seconds, the GPU and the cores to themselves
bench() {
  local limit=$1 t0=$SECONDS
  pkill -f cuda-gdb; pkill -f "build_ext --inplace"
  # host time per eager call, per backend (at most 60 s of the limit); BENCH_EXTRAS=0 skips it and the next
  [ "${BENCH_EXTRAS:-1}" = 1 ] && [ "$limit" -ge 120 ] && run host-overhead "$OUT/bench.log" 60 "$PYTHON" tools/host_overhead.py
  # device time per kernel of the cases behind their targets (at most 60 s)
  [ "${BENCH_EXTRAS:-1}" = 1 ] && [ "$limit" -ge 180 ] && run kernel-times "$OUT/bench.log" 60 "$PYTHON" tools/gpu_kernel_times.py
  limit=$((limit - (SECONDS - t0)))
  run bench "$OUT/bench.log" "$limit" "$PYTHON" -m benchmarks.run --device cuda --rounds 2 \
    --budget-s "$((limit - 55))" --out "$OUT/bench" ${BENCH_ARGS:-}
}
# BENCH_FIRST=1: the benchmarks before the tests (their BENCH_S seconds first), e.g. to time a changed kernel
[ -n "${BENCH_FIRST:-}" ] && bench "$bench_min"

# 2. pytest and the sanitizer, side by side
# 25 s kept for the sanitizers' kill grace (10 s) and the logs' assembly
reserve=$((bench_min + 25))
[ -n "${BENCH_FIRST:-}" ] && reserve=25
cap=$(($(left) - reserve))
if [ "$cap" -ge 30 ]; then
  OUT=$OUT timeout 200 bash tools/gpu_diag.sh &
  OUT=$OUT timeout "$cap" bash tools/gpu_diag.sh slow &
fi
pytest=("$PYTHON" -m pytest -p no:cacheprovider -rfE --tb=short --maxfail=300 -o faulthandler_timeout=120)
cpu_only=(--ignore=tests/test_cuda_emulation.py --ignore=tests/test_patch.py --ignore=tests/test_tooling.py
  --ignore=tests/test_build.py)
workers=(-n "${WORKERS:-10}")
"$PYTHON" -c "import xdist" 2>/dev/null || workers=()  # without pytest-xdist: one process
# GPU tests only: the ids and names with cuda or triton but not the host emulation (CI runs the rest); PYTEST_K=""
# runs everything.
run pytest "$OUT/pytest.log" "$cap" env FUSED_TEST_CPU=0 "${pytest[@]}" -v "${workers[@]}" "${cpu_only[@]}" \
  -k "${PYTEST_K-(cuda or triton) and not emulation}" ${SUITE_TESTS:-tests} &

sanitizer=$(command -v compute-sanitizer || ls "$cuda_home/bin/compute-sanitizer" /usr/local/cuda/bin/compute-sanitizer \
  2>/dev/null | head -1)
mkdir -p "$WORK/san"
if [ -n "$sanitizer" ]; then
  # tool, files, -k filter; the CUDA C++ tests of one family each
  jobs=(
    "memcheck|tests/test_elementwise.py|cuda-cuda"
    "memcheck|tests/test_linear.py|cuda-cuda"
    "memcheck|tests/test_distance.py tests/test_geometry.py|cuda-cuda"
    "memcheck|tests/test_loss.py tests/test_logprob.py|cuda-cuda"
    "memcheck|tests/test_norm.py tests/test_rope.py|cuda-cuda"
    "memcheck|tests/test_optim_cuda.py tests/test_optim_state8.py tests/test_clip.py|cuda"
    "racecheck|tests/test_norm.py tests/test_loss.py|cuda-cuda"
    "racecheck|tests/test_elementwise.py tests/test_optim_cuda.py|cuda-cuda and (bias or dropout) or clip_grad or cuda_matches"
    "synccheck|tests/test_norm.py tests/test_loss.py tests/test_optim_cuda.py|cuda"
    "initcheck|tests/test_norm.py tests/test_rope.py tests/test_elementwise.py|cuda-cuda"
    "initcheck|tests/test_loss.py tests/test_logprob.py tests/test_optim_cuda.py tests/test_linear.py|cuda"
  )
  i=0
  for job in "${jobs[@]}"; do
    IFS='|' read -r tool files filter <<<"$job"
    [[ $job =~ ${SANITIZE_ONLY:-.} ]] || continue  # a regex over "tool|files|filter": a subset of the jobs
    i=$((i + 1))
    # Without the caching allocator every tensor is its own allocation, so memcheck sees out-of-bounds accesses.
    # Left to the plain pytest: launch counts (the profiler's CUPTI does not run under the sanitizer) and CUDA
    # graph capture (each allocation is then a cudaMalloc, which a capture forbids). The host emulation runs no GPU code.
    # shellcheck disable=SC2086
    run "$tool $files" "$WORK/san/$i.log" "$cap" env FUSED_BACKEND=cuda PYTORCH_NO_CUDA_MEMORY_CACHING=1 \
      "$sanitizer" --tool "$tool" --target-processes all --error-exitcode 86 --print-limit 20 \
      "${pytest[@]}" -q $files -k "($filter) and not triton and not compile and not opcheck and not launches and not graph and not emulation" &
  done
else
  echo "FAILED  sanitize: compute-sanitizer not found" >"$WORK/0.log.summary"
fi
wait
cat "$WORK"/[0-9]*.log.summary >"$OUT/sanitizer.log" 2>/dev/null
for f in "$WORK"/san/[0-9]*.log; do
  [ -f "$f" ] || continue
  echo "---- $f" >>"$OUT/sanitizer.log"
  tail -c 200000 "$f" >>"$OUT/sanitizer.log"
done

# 3. benchmarks, the GPU and the cores to themselves
[ -z "${BENCH_FIRST:-}" ] && bench "$(($(left) - 10))"
echo
echo "== gpu_suite summary ($((SECONDS - start))s; logs under $OUT)"
failed=0
for f in "$WORK/install.log.summary" "$WORK/pytest.log.summary" "$OUT/sanitizer.log" "$WORK/bench.log.summary"; do
  [ -f "$f" ] || continue
  grep -a "^ok\|^FAILED" "$f"
  grep -aq "^FAILED" "$f" && failed=1
done
cat "$WORK"/*.summary >>"$OUT/install.log" 2>/dev/null
# The tail of the failures, so the reply's last lines carry them.
grep -aE "^(FAILED|ERROR) " "$OUT/pytest.log" | cut -c1-220 | head -60
exit $failed
