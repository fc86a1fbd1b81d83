# make test: the parity suite;  make bench: the benchmark suite (CPU by default, the GPU when one is present).
# Both install what they need on a fresh machine that has only Python. make lint (part of make test): the style
# checks, ruff for Python and clang-format for csrc/ (configs in pyproject.toml and .clang-format), seconds.
PYTHON ?= python3
PIP = $(PYTHON) -m pip install --quiet --disable-pip-version-check
RUFF_VERSION = 0.17.6
CLANG_FORMAT_VERSION = 23.1.5

.PHONY: setup setup-test-peers setup-bench-peers test bench lint cuda-check torch-headers-check clean

setup:
	@# Never an unpinned torch: on a CPU machine it pulls gigabytes of CUDA packages.
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) torch==2.13.0
	@$(PYTHON) -c "import triton, pytest, hypothesis, matplotlib, numpy, ninja, rich, wheel, expecttest" \
		2>/dev/null || $(PIP) triton pytest hypothesis matplotlib numpy ninja rich wheel expecttest
	@# fused.patch's tests (tests/test_patch.py: with PEFT's LoRA and accelerate's offload hooks too); these
	@# depend on torch without pulling another one.
	@$(PYTHON) -c "import transformers, peft, accelerate" 2>/dev/null || \
		$(PIP) "transformers>=5.24,<6" "peft>=0.21,<1" "accelerate>=1.15,<2"
	@# The formatters pinned: another version formats differently and would fail make lint on unchanged code.
	@$(PYTHON) -c "from importlib.metadata import version as v; assert (v('ruff'), v('clang-format')) == \
		('$(RUFF_VERSION)', '$(CLANG_FORMAT_VERSION)')" 2>/dev/null || \
		$(PIP) ruff==$(RUFF_VERSION) clang-format==$(CLANG_FORMAT_VERSION)
	$(PIP) --no-build-isolation --no-deps -e .

# The libraries our tests and benchmarks compare against, where they install (each comparison skips cleanly
# without its library): bitsandbytes' AdamW8bit (the int8 state's training tests and benchmark), faiss-cpu (k-NN),
# torchao's AdamW8bit. Their wheels depend on torch without pulling another one.
setup-test-peers:
	@$(PYTHON) -c "import bitsandbytes" 2>/dev/null || $(PIP) bitsandbytes || echo "bitsandbytes did not install: its comparisons skip"

setup-bench-peers: setup-test-peers
	@$(PYTHON) -c "import faiss" 2>/dev/null || $(PIP) faiss-cpu || echo "faiss-cpu did not install: its rows are left out"
	@$(PYTHON) -c "import torchao" 2>/dev/null || $(PIP) torchao || echo "torchao did not install: its rows are left out"

test: setup setup-test-peers lint cuda-check torch-headers-check
	$(PYTHON) -m pytest -q tests

# make bench: a representative case per op and dtype (4-5 minutes on 2 CPU cores); make bench FULL=1: all.
bench: setup setup-bench-peers
	$(PYTHON) -m benchmarks.run $(if $(FULL),--full)

# The pinned clang-format (the pip package's binary), whatever else is on PATH.
CLANG_FORMAT = $(shell $(PYTHON) -c "import clang_format; print(clang_format.get_executable('clang-format'))" 2>/dev/null)
CSRC = $(shell git ls-files 'csrc/*.h' 'csrc/*.cpp' 'csrc/*.cu' 'csrc/*.cuh')

lint:
	@$(PYTHON) -m ruff --version >/dev/null && [ -x "$(CLANG_FORMAT)" ] || \
		{ echo "lint: ruff or clang-format missing; make setup installs them"; exit 1; }
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .
	@echo "clang-format --dry-run --Werror (csrc/: $(words $(CSRC)) files)"
	@$(CLANG_FORMAT) --dry-run --Werror $(CSRC)

# Compiles every CUDA source with nvcc (sm_90, compile only) when nvcc is present, GPU or not.
cuda-check:
	@if command -v nvcc >/dev/null 2>&1; then PYTHON=$(PYTHON) bash tools/check_cuda.sh; else echo "nvcc not found: CUDA compile check skipped"; fi

# Every csrc/*.cpp through g++ -fsyntax-only against the newest torch's headers (2.15: C++20), taken once from its
# wheel into ~/.cache/fused (2.14 where pip cannot get 2.15); skipped with one line where pip gets neither.
torch-headers-check:
	$(PYTHON) tools/check_torch_headers.py

clean:
	rm -rf build *.egg-info fused/_C*.so
