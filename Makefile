# Two entry points for a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch lies on disk here; GPU users install their CUDA torch first (see README).
TORCH_SPEC ?= torch==2.13.0

.PHONY: install demo test lint clean wheels

# setup.py builds the sandbox's C extension in place (src/lorapop/verify/_kernel*.so).
# pip byte-compiles what it installs one file at a time; compileall does the venv on every core
# (half the time on two). Files that do not compile (a few packages ship some) are skipped, as
# pip skips them.
$(BIN)/.installed: pyproject.toml setup.py src/lorapop/verify/_kernel.c Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q --no-compile "$(TORCH_SPEC)"
	$(BIN)/pip install -q --no-compile -e '.[dev]'
	$(BIN)/python -m compileall -qq -j 0 $(VENV)/lib || true
	touch $@

install: $(BIN)/.installed

demo: install
	$(BIN)/lorapop train configs/tiny.yaml --out runs/tiny run.with_baseline=true

# one process per core (pytest-xdist), one torch thread each: two workers of two threads
# on two cores ran slower than one
test: install
	$(BIN)/ruff check src tests benchmarks experiments scripts
	OMP_NUM_THREADS=1 $(BIN)/pytest -n auto --dist worksteal

lint: install
	$(BIN)/ruff check src tests benchmarks experiments scripts

# lorapop's dependencies that a GPU image with torch, transformers and peft lacks, as wheels at
# the versions installed here, for a machine without an index (the benchmarks' device runs):
# there, `pip install --no-index --no-deps --target DIR .whl/*.whl` and PYTHONPATH=DIR:src.
# The one compiled wheel (pydantic_core) is fetched for WHEEL_PY on manylinux x86_64.
OFFLINE_DEPS := pydantic annotated-types typing-inspection typing_extensions radon mando \
	math-verify latex2sympy2_extended antlr4-python3-runtime pyseccomp landlock trueskill
WHEEL_PY ?= 3.12
pinned = $(shell $(BIN)/python -c "import importlib.metadata as m; \
	print(' '.join(f'{p}=={m.version(p)}' for p in '$(1)'.split()))")

wheels: install
	rm -rf .whl && mkdir -p .whl
	$(BIN)/pip wheel -q --no-deps -w .whl $(call pinned,$(OFFLINE_DEPS))
	$(BIN)/pip download -q --no-deps --only-binary=:all: --python-version $(WHEEL_PY) \
		--implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d .whl $(call pinned,pydantic_core)

clean:
	rm -rf $(VENV) build src/*.egg-info src/lorapop/verify/_kernel*.so
