#!/usr/bin/env bash
# Compiles every CUDA kernel source (.cu, torch-free) with nvcc for sm_90, compile only: CUDA code that does
# not compile cannot land, although CI has no GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(mktemp -d)
status=0
for f in $(find csrc -name '*.cu' | sort); do
  if nvcc -std=c++17 -O3 -arch=sm_90 -Icsrc -c "$f" -o "$out/$(basename "$f").o"; then
    echo "nvcc ok: $f"
  else
    echo "nvcc FAILED: $f"; status=1
  fi
done
rm -rf "$out"
exit $status
