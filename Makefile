# The two commands the README promises: `make demo` and `make test`.
# Each creates its own virtual environment when it is missing.
PYTHON ?= python3
GPU_PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.chunkmem-installed

.PHONY: venv demo test test-integration test-threads test-slow bench bench-deps lint clean cuda-check gpu-check gpu-wheels

venv: $(STAMP)

# With no torch present, take torch==2.13.0 explicitly: an unpinned `torch` would pull a
# multi-GB CUDA build on a CPU machine. A torch already in the venv that satisfies
# setup.cfg's range (a CUDA build, say) is kept.
$(STAMP): setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

# A short `chunkmem train` run (GPT 4x128 on Python's stdlib sources, a 5 MiB device for
# 13 MiB of model states), then a second run resumed from its step-250 checkpoint that
# retrains steps 251-300 and compares their losses with the first run's. The resumed run's
# directory is the demo's own output, removed first so that a second `make demo` can resume.
demo: $(STAMP)
	$(VENV)/bin/chunkmem train --out runs/demo --set train.checkpoint_every=250
	rm -rf runs/demo-resumed
	$(VENV)/bin/chunkmem train --out runs/demo-resumed --resume runs/demo/checkpoints/step_000250

# One worker per core (pytest-xdist): the tests run one torch thread each. The end-to-end
# cases that launch several processes (the command line's ranks, Lightning's launcher,
# torchrun, the docs' examples) are `make test-integration`; CI runs both.
test: $(STAMP)
	$(PY) -m pytest -q -n auto

test-integration: $(STAMP)
	$(PY) -m pytest -q -n auto -m integration

# The engine-level tests (numbers compared with PyTorch, across processes and ranks), not the
# kernel matrix, with 2 torch threads in every process (docs/reproducibility.md): catches the
# next assumption that one thread hides.
ENGINE_TESTS := $(addprefix tests/test_,training_matches_torch zero offload checkpoints \
	hf_models hf_torchrun engine_features aborts failures zeropp evaluation schedulers \
	estimate cli deepspeed_config nvme trainability thread_world)
test-threads: $(STAMP)
	CHUNKMEM_TEST_THREADS=2 $(PY) -m pytest -q -n auto $(addsuffix .py,$(ENGINE_TESTS))

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

bench: $(STAMP)
	for b in chunk_traffic overhead max_model; do $(PY) -m benchmarks.$$b || exit 1; done

# The peers the benchmarks compare against that `make venv` leaves out (setup.cfg's `bench`
# extra: DeepSpeed, scipy). Without them `scale` and `zero_vs_peers` skip DeepSpeed's rows
# and say so. With torch already in the venv, pip keeps it.
bench-deps: $(STAMP)
	$(PY) -m pip install --quiet -e ".[bench]"

# Which benchmarks/results/*.json are older than the code they measure (benchmarks/staleness.py,
# docs/benchmarks.md): git and the standard library only, no venv, no benchmark runs. Exit 1
# when a result is stale.
.PHONY: bench-check
bench-check:
	$(PYTHON) -m benchmarks.staleness

# Compile-check every CUDA source for Ampere and Hopper with the flags the loader uses
# (kernels/_cuda.py). Needs no GPU; without nvcc it says so and passes.
NVCC ?= nvcc
CUDA_ARCHS := sm_80 sm_90
cuda-check:
	@if ! command -v $(NVCC) >/dev/null 2>&1; then echo "cuda-check: $(NVCC) not found, CUDA sources not checked"; exit 0; fi; \
	for f in kernels/csrc/*.cu; do for a in $(CUDA_ARCHS); do \
	  echo "nvcc -arch=$$a $$f"; \
	  $(NVCC) -c -o /dev/null -arch=$$a --std=c++17 -O3 --fmad=false --ftz=false --prec-div=true \
	    --prec-sqrt=true -Xcompiler -ffp-contract=off -Werror all-warnings $$f || exit 1; \
	done; done

# On a machine with a GPU (docs/gpu.md): pytest -m cuda and benchmarks.gpu --quick with the
# python3 that holds torch, log and results into OUT, non-zero exit if a test fails. Installs
# what that python lacks from .whl/, which `make gpu-wheels` fills on a machine with network.
gpu-check:
	@test -n "$(OUT)" || { echo "usage: make gpu-check OUT=<dir>  (docs/gpu.md)"; exit 2; }
	PYTHON=$(GPU_PYTHON) bash .ci/gpu-check "$(OUT)"

gpu-wheels:
	PYTHON=$(PYTHON) bash .ci/gpu-wheels

lint: $(STAMP)
	$(PY) -m ruff check chunkmem zero offload kernels tests benchmarks

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
