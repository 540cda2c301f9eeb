# The two commands of the README: `make demo` (the main job) and `make test`.
# Each creates and fills .venv when it is missing or out of date with setup.py.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test lint bench

$(BIN)/.installed: setup.py
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -e '.[dev]'
	touch $@

demo: $(BIN)/.installed
	PATH=$(CURDIR)/$(BIN):$$PATH bash data/run_demo.sh

test: $(BIN)/.installed
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q tests

bench: $(BIN)/.installed
	$(BIN)/python scripts/bench_generate.py
