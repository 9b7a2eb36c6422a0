# The two entry commands (see README): `make run` and `make test` (the whole suite, what CI runs). Both set up .venv
# first. `make test-fast`: lint, then the unit and contract tests only (the inner loop while changing code).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: run test test-fast lint
run: $(VENV)/.installed
	$(BIN)/fedge run

test: lint
	$(BIN)/python -m pytest

test-fast: lint
	$(BIN)/python -m pytest tests/unit tests/contract

lint: $(VENV)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $@
