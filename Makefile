# make test: the parity suite;  make bench: the benchmark suite (CPU by default, the GPU when one is present).
# Both install what they need on a fresh machine that has only Python.
PYTHON ?= python3
PIP = $(PYTHON) -m pip install --quiet --disable-pip-version-check

.PHONY: setup test bench cuda-check clean

setup:
	@# Never an unpinned torch: on a CPU machine it pulls gigabytes of CUDA packages.
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) torch==2.13.0
	@$(PYTHON) -c "import triton, pytest, hypothesis, matplotlib, numpy, ninja, rich, wheel" 2>/dev/null || \
		$(PIP) triton pytest hypothesis matplotlib numpy ninja rich wheel
	$(PIP) --no-build-isolation --no-deps -e .

test: setup cuda-check
	$(PYTHON) -m pytest -q tests

bench: setup
	$(PYTHON) -m benchmarks.run

# Compiles every CUDA source with nvcc (sm_90, compile only) when nvcc is present, GPU or not.
cuda-check:
	@if command -v nvcc >/dev/null 2>&1; then PYTHON=$(PYTHON) bash tools/check_cuda.sh; else echo "nvcc not found: CUDA compile check skipped"; fi

clean:
	rm -rf build *.egg-info fused/_C*.so
