# One entry point for every task; CI runs `make test`.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint unit integration conformance engines bench docs clean

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) (Python 3.11)"; exit 1; }
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[dev]'
	@touch $(STAMP)

## Start a router, an agent and an engine simulator on loopback, in the foreground.
run: $(STAMP)
	$(BIN)/python scripts/run_local.py

## Lint, type-check and run every test (real llama.cpp engines included).
test: $(STAMP) lint engines
	HIVENET_REQUIRE_REAL_ENGINES=1 $(BIN)/python -m pytest -q -p no:cacheprovider

## Build llama-server and the two test models once per version, cached outside the repo.
engines:
	PYTHON=$(PYTHON) scripts/real_engines.sh >/dev/null

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

## Spec conformance and the fuzzing run; FUZZ_EXAMPLES=500 for a longer one.
conformance: $(STAMP) engines
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/conformance

## Router overhead benchmark (not in CI); results go to docs/benchmarks.md.
bench: $(STAMP)
	$(BIN)/python bench/overhead.py $(ARGS)

docs: $(STAMP)
	$(BIN)/python scripts/gen_config_docs.py
	$(BIN)/python scripts/gen_policy_schema.py

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .ruff_cache
