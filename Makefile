# The two entry commands (see README): `make run` and `make test` (the whole suite, what CI runs). Both set up .venv
# first. `make test-fast`: the lint and the unit, method and contract tests, side by side (the inner loop while changing
# code).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# test-fast runs the lint and two halves of the tests side by side: the paths of FAST_FIRST, and the rest of tests/unit,
# tests/methods and tests/contract. OMP_NUM_THREADS=1 keeps torch at one thread in both and in the commands their tests
# start (two threads each on two cores made tests 5-10x slower). Tests marked `full` (pyproject.toml: every fedge
# command of the docs, the two largest BatchNorm exports' parity) are left to `make test`.
FAST_FIRST := tests/unit/export/test_parity.py tests/unit/export/test_pte.py tests/unit/export/test_executorch_cli.py \
	tests/unit/edge_client
FAST_PYTEST := OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -p no:cacheprovider --durations=10 -m "not full"

.PHONY: run test test-fast test-fast-first test-fast-rest lint
run: $(VENV)/.installed
	$(BIN)/fedge run

test: lint
	$(BIN)/python -m pytest

test-fast: $(VENV)/.installed
	$(MAKE) --no-print-directory -j3 --output-sync=target lint test-fast-first test-fast-rest

test-fast-first: $(VENV)/.installed
	$(FAST_PYTEST) $(FAST_FIRST)

test-fast-rest: $(VENV)/.installed
	$(FAST_PYTEST) tests/unit tests/methods tests/contract $(addprefix --ignore=,$(FAST_FIRST))

lint: $(VENV)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $@
