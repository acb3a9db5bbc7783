# Two targets do everything on a fresh machine: `make demo` and `make test` (see README).
# GPU users: create .venv and install the torch build for your CUDA first; `make` keeps whatever torch it finds.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
LMMS_EVAL_SPEC ?= lmms-eval==0.7.3
export HF_HUB_OFFLINE ?= 1

.PHONY: install lmms-eval demo lint test test-fast bench clean-demo

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	# s3fs first (its aiobotocore pins botocore; datasets beside it, as it caps fsspec, s3fs's twin), then the rest
	# with boto3 (moto's) held to that botocore: pip backtracks through hundreds of boto3 releases otherwise
	$(PY) -m pip install -q "s3fs>=2024.2" "datasets>=2.14"
	$(PY) -m pip install -q -e ".[dev]" "boto3==$$($(PY) -c 'import botocore; print(botocore.__version__)')"
	$(PY) -c "import lmms_eval" 2>/dev/null || $(MAKE) --no-print-directory lmms-eval
	touch $@

# lmms-eval (the `eval` extra) requires torchvision. With a torch that has its torchvision, pip installs it as usual;
# with a CPU torch (PyPI's torchvision needs PyPI's CUDA torch and would replace it) it is installed without torchvision.
lmms-eval:
	if $(PY) -c "import torchvision" 2>/dev/null; then $(PY) -m pip install -q "$(LMMS_EVAL_SPEC)"; else \
	  $(PY) -m pip install -q --no-deps "$(LMMS_EVAL_SPEC)" && \
	  $(PY) scripts/lmms_eval_requirements.py > $(VENV)/lmms-eval-requirements.txt && \
	  $(PY) -m pip install -q -r $(VENV)/lmms-eval-requirements.txt; fi

install: $(VENV)/.installed

MC := runs/synthetic-mc
# The main job on the embedded default: tiny models, synthetic data; precompute, then stage-1 training + summary;
# then the trained model describes two unseen scenes and is scored on 256 of them (true caption vs one-word edits),
# then describes all 256 and its descriptions are scored against their true captions (BLEU-4, ROUGE-L, CIDEr).
demo: install
	$(PY) -m precompute.cosmos_latents --config configs/precompute.yaml
	$(PY) -m train.loop --config configs/stage1.yaml
	$(PY) -m theworld.evaluate --make-synthetic 256 --data $(MC)/items.jsonl
	@echo "two unseen scenes, described by runs/stage1 (true captions: $(MC)/items.jsonl):"
	$(PY) -m theworld.describe --model runs/stage1 --image $(MC)/images/1-000000.png $(MC)/images/1-000001.png
	$(PY) -m theworld.evaluate --model runs/stage1 --data $(MC)/items.jsonl
	$(PY) -m theworld.evaluate --model runs/stage1 --task caption --data $(MC)/captions.jsonl --max-new-tokens 24

# The configuration is in pyproject.toml ([tool.ruff]).
lint: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

test: lint
	$(PY) -m pytest -q

# The inner loop: everything but the tests that start whole runs in subprocesses (marked `slow`).
test-fast: install
	$(PY) -m pytest -q -m "not slow"

bench: install
	$(PY) -m precompute.bench
	$(PY) -m train.bench
	$(PY) -m train.bench_generate
	$(PY) -m train.bench_eval

clean-demo:
	rm -rf cache/latents runs
