# Two targets do everything on a fresh machine: `make demo` and `make test` (see README).
# GPU users: create .venv and install the torch build for your CUDA first; `make` keeps whatever torch it finds.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
export HF_HUB_OFFLINE ?= 1

.PHONY: install demo test test-fast bench clean-demo

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

install: $(VENV)/.installed

# The main job on the embedded default: tiny models, synthetic data; precompute, then stage-1 training + summary.
demo: install
	$(PY) -m precompute.cosmos_latents --config configs/precompute.yaml
	$(PY) -m train.loop --config configs/stage1.yaml

test: install
	$(PY) -m pytest -q

# The inner loop: everything but the tests that start whole runs in subprocesses (marked `slow`).
test-fast: install
	$(PY) -m pytest -q -m "not slow"

bench: install
	$(PY) -m precompute.bench
	$(PY) -m train.bench

clean-demo:
	rm -rf cache/latents runs
