# Two entry points for a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch lies on disk here; GPU users install their CUDA torch first (see README).
TORCH_SPEC ?= torch==2.13.0

.PHONY: install demo test lint clean

$(BIN)/.installed: pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

install: $(BIN)/.installed

demo: install
	$(BIN)/lorapop train configs/tiny.yaml --out runs/tiny run.with_baseline=true

test: install
	$(BIN)/ruff check src tests benchmarks scripts
	$(BIN)/pytest

lint: install
	$(BIN)/ruff check src tests benchmarks scripts

clean:
	rm -rf $(VENV) build src/*.egg-info
