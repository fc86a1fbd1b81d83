# make test: the parity suite;  make bench: the benchmark suite (CPU by default, the GPU when one is present).
# Both install what they need on a fresh machine that has only Python. make lint: the style checks (ruff for
# Python, clang-format for csrc/; configs in pyproject.toml and .clang-format), seconds.
PYTHON ?= python3
PIP = $(PYTHON) -m pip install --quiet --disable-pip-version-check

.PHONY: setup test bench lint cuda-check clean

setup:
	@# Never an unpinned torch: on a CPU machine it pulls gigabytes of CUDA packages.
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) torch==2.13.0
	@$(PYTHON) -c "import triton, pytest, hypothesis, matplotlib, numpy, ninja, rich, wheel, ruff, clang_format" \
		2>/dev/null || $(PIP) triton pytest hypothesis matplotlib numpy ninja rich wheel ruff clang-format
	$(PIP) --no-build-isolation --no-deps -e .

test: setup cuda-check
	$(PYTHON) -m pytest -q tests

bench: setup
	$(PYTHON) -m benchmarks.run

CSRC = $(shell git ls-files 'csrc/*.h' 'csrc/*.cpp' 'csrc/*.cu' 'csrc/*.cuh')

lint:
	@command -v clang-format >/dev/null && $(PYTHON) -m ruff --version >/dev/null || \
		{ echo "lint: ruff or clang-format missing; make setup installs them"; exit 1; }
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .
	clang-format --dry-run --Werror $(CSRC)

# Compiles every CUDA source with nvcc (sm_90, compile only) when nvcc is present, GPU or not.
cuda-check:
	@if command -v nvcc >/dev/null 2>&1; then PYTHON=$(PYTHON) bash tools/check_cuda.sh; else echo "nvcc not found: CUDA compile check skipped"; fi

clean:
	rm -rf build *.egg-info fused/_C*.so
