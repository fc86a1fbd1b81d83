#!/usr/bin/env bash
# A/B of kernel changes on a lent GPU, in one call: builds the extension in place (setup.py build_ext --inplace) and
# keeps that library as variant A; for each PATCH, applies it (git apply), rebuilds (ninja recompiles only the
# changed sources), keeps that library and reverts the patch. Then runs AB_CMD with each variant in turn, AB_ROUNDS
# rounds, a fresh process each: A with the tree as it is, a patch's variant with the patch applied (its Python and
# Triton changes too) and its library swapped in. Usage: OUT=dir bash tools/gpu_ab.sh PATCH...
#   AB_CMD     the timing command, a bash command line (default: tools/gpu_adam_times.py, one AdamW step with fp32,
#              bf16 and int8 state on both backends)
#   AB_ROUNDS  rounds over the variants (default 2)
# Logs under $OUT: build.log, ab.log (each run headed "== VARIANT round r"). Exits 1 if a build or a run fails.
set -uo pipefail
cd "$(dirname "$0")/.."
[ $# -gt 0 ] || { echo "usage: OUT=dir bash tools/gpu_ab.sh PATCH..."; exit 1; }
patches=()
for p in "$@"; do patches+=("$(realpath "$p")"); done
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
rm -f "$OUT/build.log" "$OUT/ab.log"
PYTHON=${PYTHON:-python3}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-$(nproc)} PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # the in-place build, not an installed copy
cmd=${AB_CMD:-"$PYTHON tools/gpu_adam_times.py"}
work=$(mktemp -d)

build() {  # build NAME: the extension in place, its library kept as $work/NAME.so
  echo "== build $1" >>"$OUT/build.log"
  "$PYTHON" setup.py build_ext --inplace >>"$OUT/build.log" 2>&1 || { echo "build $1 failed (build.log)"; return 1; }
  cp fused/_C*.so "$work/$1.so"
}
for p in "${patches[@]}"; do git apply --check "$p" || exit 1; done
build A || exit 1
variants=(A)
for k in "${!patches[@]}"; do
  git apply "${patches[$k]}" && build "B$k"
  built=$?
  git apply -R "${patches[$k]}"
  [ $built -eq 0 ] || exit 1
  variants+=("B$k")
  echo "B$k: $(basename "${patches[$k]}")" | tee -a "$OUT/ab.log"
done

lib=$(ls fused/_C*.so)
failed=0
for r in $(seq "${AB_ROUNDS:-2}"); do
  for v in "${variants[@]}"; do
    cp "$work/$v.so" "$lib"
    patch=""
    [ "$v" != A ] && patch=${patches[${v#B}]} && git apply "$patch"
    echo "== $v round $r: $cmd" >>"$OUT/ab.log"
    bash -c "$cmd" >>"$OUT/ab.log" 2>&1 || { echo "$v round $r failed (ab.log)"; failed=1; }
    [ -n "$patch" ] && git apply -R "$patch"
  done
done
cp "$work/A.so" "$lib"  # the tree's own build again
grep -aE "^== |^B[0-9]+: |fused\[(cuda|triton)\]" "$OUT/ab.log"
exit $failed
