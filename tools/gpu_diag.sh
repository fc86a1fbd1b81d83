#!/usr/bin/env bash
# Toolchain report and a crash probe for the GPU machine: which compilers built fused._C, which C++ runtime the
# process loads, and whether a CPU kernel's argument error (a c10::Error thrown through our frames) comes back as a
# Python exception. Variants (CPU-only builds in /tmp, at low priority) tell the compiler and the ISA apart.
# Usage: OUT=dir bash tools/gpu_diag.sh [slow]   -> $OUT/diag.log   (slow: the backtrace and the variant builds)
set -uo pipefail
cd "$(dirname "$0")/.."
log=${OUT:-gpu_out}/diag.log
part=${DIAG_WORK:-/tmp}/diag  # the slow probes' parts, joined into $log at the end (only 8 files of $OUT come back)
probe='import torch, fused
x = torch.randn(4, 8)
try:
    fused.bias_act(x, None, "swish")
except Exception as e:
    print("probe ok:", fused.__file__, type(e).__name__, str(e).splitlines()[0])'
if [ "${1:-}" != slow ]; then {
  echo "== toolchain"; which -a g++ c++ gcc; g++ --version | head -1; ls /usr/bin/g++* 2>/dev/null
  echo "CXX=${CXX:-} CC=${CC:-}"; grep -m1 "model name" /proc/cpuinfo; grep -o "avx512[a-z]*" /proc/cpuinfo | sort -u | tr '\n' ' '; echo
  python3 -c "import torch; print(torch.__config__.show())" | head -12
  so=$(ls fused/_C*.so); ldd "$so" | grep -E "stdc|gcc_s|gomp|torch|c10"
  echo "== probe (as built)"; timeout 60 python3 -c "$probe"; echo "rc=$?"
  lib=$(g++ -print-file-name=libstdc++.so.6); gcc_s=$(g++ -print-file-name=libgcc_s.so.1)
  echo "== probe with the compiler's runtime preloaded: $lib $gcc_s"
  LD_PRELOAD="$lib:$gcc_s" timeout 60 python3 -c "$probe"; echo "rc=$?"
  # the same error after other work in the process: which one makes it crash (a parallel CPU op, a CUDA kernel of
  # ours, a Triton kernel, an inductor-compiled CPU function)
  for first in "fused.bias_act(torch.randn(4096, 1024), None, 'gelu')" \
    "fused.bias_act(torch.randn(64, 64, device='cuda'), None, 'gelu'); torch.cuda.synchronize()" \
    "fused.set_backend('triton'); fused.bias_act(torch.randn(64, 64, device='cuda'), None, 'gelu'); torch.cuda.synchronize()" \
    "torch.compile(lambda t: t.sin() + 1)(torch.randn(8))"; do
    echo "== probe after: $first"
    timeout 120 python3 -c "import torch, fused
$first
$(echo "$probe" | tail -n +2)"
    echo "rc=$?"
  done
} >>"$log" 2>&1; exit 0; fi
(echo "== backtrace"; cuda-gdb -batch -ex run -ex bt --args python3 -c "$probe" 2>&1 | grep -vE "^\[(New|Thread)|^warning:" |
  tail -60) >>"$part.bt" 2>&1 &
# variant builds: CPU only, in copies; $2.. name them: avx2 (same compiler, AVX2 kernels), sysgcc (/usr/bin/g++)
variant() {
  local name=$1
  shift
  rm -rf "/tmp/v-$name" && mkdir -p "/tmp/v-$name" && cp -r setup.py csrc fused "/tmp/v-$name/"
  (cd "/tmp/v-$name" && env FUSED_NO_CUDA=1 "$@" nice -n 10 python3 setup.py -q build_ext --inplace >build.log 2>&1) ||
    { echo "== variant $name: build failed"; tail -5 "/tmp/v-$name/build.log"; return; }
  echo "== probe, variant $name ($*)"
  (cd "/tmp/v-$name" && PYTHONPATH=. timeout 60 python3 -c "$probe"; echo "rc=$?")
}
variant avx2 FUSED_CPU_ARCH=avx2 >>"$part.avx2" 2>&1 &
[ -x /usr/bin/g++ ] && [ "$(readlink -f /usr/bin/g++)" != "$(readlink -f "$(command -v g++)")" ] &&
  variant sysgcc CXX=/usr/bin/g++ CC=/usr/bin/g++ >>"$part.sysgcc" 2>&1 &
wait
cat "$part".* >>"$log" 2>/dev/null
rm -f "$part".*
