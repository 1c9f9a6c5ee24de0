# The two commands the README promises: `make demo` and `make test`.
# Each creates its own virtual environment when it is missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.chunkmem-installed

.PHONY: venv demo test test-slow bench lint clean

venv: $(STAMP)

# With no torch present, take torch==2.13.0 explicitly: an unpinned `torch` would pull a
# multi-GB CUDA build on a CPU machine. A torch already in the venv that satisfies
# setup.cfg's range (a CUDA build, say) is kept.
$(STAMP): setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m chunkmem.demo

test: $(STAMP)
	$(PY) -m pytest -q

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

bench: $(STAMP)
	for b in chunk_traffic overhead max_model; do $(PY) -m benchmarks.$$b || exit 1; done

lint: $(STAMP)
	$(PY) -m ruff check chunkmem zero offload kernels tests benchmarks

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
