#!/usr/bin/env bash
# A/B of a kernel change on a lent GPU, in one call: builds the extension in place (setup.py build_ext --inplace),
# keeps that library as A, applies PATCH (git apply) and rebuilds (ninja recompiles only the changed sources), keeps
# that as B, then runs AB_CMD with A and B alternately (AB_ROUNDS rounds, a fresh process each): A with the tree as
# it is, B with the patch applied (its Python and Triton changes too) and its library swapped in. Usage:
# OUT=dir bash tools/gpu_ab.sh PATCH
#   AB_CMD     the timing command, a bash command line (default: the optimizer benchmark's plain AdamW case with
#              fp32, bf16 and int8 state, both backends)
#   AB_ROUNDS  rounds of A then B (default 2)
# Logs under $OUT: build.log, ab.log (each run headed "== A round r" / "== B round r"). Exits 1 if a step fails.
set -uo pipefail
cd "$(dirname "$0")/.."
patch=$(realpath "${1:?usage: OUT=dir bash tools/gpu_ab.sh PATCH}")
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
rm -f "$OUT/build.log" "$OUT/ab.log"
PYTHON=${PYTHON:-python3}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-$(nproc)} PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # the in-place build, not an installed copy
cmd=${AB_CMD:-"$PYTHON -m benchmarks.run --device cuda --rounds 2 --only optim --match 'clipping)'"}
work=$(mktemp -d)

build() {  # build NAME: the extension in place, its library kept as $work/NAME
  echo "== build $1" >>"$OUT/build.log"
  "$PYTHON" setup.py build_ext --inplace >>"$OUT/build.log" 2>&1 || { echo "build $1 failed (build.log)"; return 1; }
  cp fused/_C*.so "$work/$1.so"
}
git apply --check "$patch" || exit 1
build A || exit 1
git apply "$patch" && build B
built=$?
git apply -R "$patch"
[ $built -eq 0 ] || exit 1

lib=$(ls fused/_C*.so)
failed=0
for r in $(seq "${AB_ROUNDS:-2}"); do
  for v in A B; do
    cp "$work/$v.so" "$lib"
    [ $v = B ] && git apply "$patch"
    echo "== $v round $r: $cmd" >>"$OUT/ab.log"
    bash -c "$cmd" >>"$OUT/ab.log" 2>&1 || { echo "$v round $r failed (ab.log)"; failed=1; }
    [ $v = B ] && git apply -R "$patch"
  done
done
cp "$work/A.so" "$lib"  # the tree's own build again
grep -aE "^== |fused\[cuda\]|fused\[triton\]" "$OUT/ab.log"
exit $failed
