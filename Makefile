# One entry point for every task; CI runs `make test`.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint unit integration bench docs clean

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) (Python 3.11)"; exit 1; }
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[dev]'
	@touch $(STAMP)

## Start a router, an agent and an engine simulator on loopback, in the foreground.
run: $(STAMP)
	$(BIN)/python scripts/run_local.py

## Lint, type-check and run every test.
test: $(STAMP) lint
	$(BIN)/python -m pytest -q -p no:cacheprovider

lint: $(STAMP)
	$(BIN)/ruff check src tests bench scripts
	$(BIN)/ruff format --check src tests bench scripts
	$(BIN)/mypy
	$(BIN)/lint-imports
	$(BIN)/python scripts/gen_config_docs.py --check
	$(BIN)/python scripts/gen_policy_schema.py --check

unit: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/unit

integration: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/integration

## Router overhead benchmark (not in CI); results go to docs/benchmarks.md.
bench: $(STAMP)
	$(BIN)/python bench/overhead.py $(ARGS)

docs: $(STAMP)
	$(BIN)/python scripts/gen_config_docs.py
	$(BIN)/python scripts/gen_policy_schema.py

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .ruff_cache
