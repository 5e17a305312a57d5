# One entry point for every task; CI runs `make test`.
# The interpreter .venv is built with: the distribution's optimized CPython 3.11 when there
# is one, for 3 to 20% less CPU per request (scripts/python.sh says why). PYTHON=... overrides.
ifndef PYTHON
PYTHON := $(shell scripts/python.sh)
endif
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# .venv remembers the interpreter that built it, and is built again for another one.
BASE := $(VENV)/.base$(subst /,-,$(realpath $(shell command -v $(PYTHON) 2>/dev/null)))

.PHONY: run run-site run-wallets test test-vllm lint unit integration conformance engines clients prometheus chromium bench bench-peers bench-routing bench-overhead bench-site bench-site-scale bench-gateway bench-bad-input bench-heavy-body bench-stream-memory soak check-accounting docs clean

$(BASE):
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) (Python 3.11)"; exit 1; }
	@$(PYTHON) -c 'import ensurepip' 2>/dev/null || { echo "$(PYTHON) cannot make a venv" \
		"(Debian: apt-get install python3.11-venv); .venv is left as it is"; exit 1; }
	rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	@touch $@

$(STAMP): pyproject.toml $(BASE)
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[dev]'
	@touch $(STAMP)

## Start a router, an agent and an engine simulator on loopback, in the foreground.
run: $(STAMP)
	$(BIN)/python scripts/run_local.py

## Start a site on loopback, in the foreground: Valkey and 3 Sentinels, 3 routers, 2 agents.
run-site: $(STAMP)
	$(BIN)/python scripts/run_site.py

## `make run` with wallets: a throwaway PostgreSQL, priced policies, a funded tenant.
run-wallets: $(STAMP)
	$(BIN)/python scripts/run_wallets.py $(ARGS)

## Lint, type-check and run every test (real llama.cpp engines included).
test: $(STAMP) lint engines clients prometheus chromium
	HIVENET_REQUIRE_REAL_ENGINES=1 $(BIN)/python -m pytest -q -p no:cacheprovider

## Build llama-server and the two test models once per version, cached outside the repo.
engines:
	PYTHON=$(PYTHON) scripts/real_engines.sh >/dev/null

## Install the real clients the tests run (Claude Code, Codex CLI), once per version, cached outside.
clients:
	scripts/claude_code.sh >/dev/null
	scripts/codex_cli.sh >/dev/null

## Install Prometheus and promtool (Debian package) for the dashboard and alert-rule tests.
prometheus:
	scripts/prometheus.sh >/dev/null

## Install Chromium and chromedriver (Debian packages) for the console's browser tests.
chromium:
	scripts/chromium.sh >/dev/null

lint: $(STAMP)
	$(BIN)/ruff check src tests bench scripts
	$(BIN)/ruff format --check src tests bench scripts
	$(BIN)/mypy
	$(BIN)/lint-imports
	$(BIN)/python scripts/gen_config_docs.py --check
	$(BIN)/python scripts/gen_policy_schema.py --check
	$(BIN)/python scripts/check_function_length.py

unit: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/unit

integration: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/integration

## The slow tier, not in CI: the same paths against real vLLM on the CPU (see docs/engines.md).
test-vllm: $(STAMP) engines
	PYTHON=$(PYTHON) scripts/vllm_engine.sh >/dev/null
	HIVENET_VLLM_TESTS=1 $(BIN)/python -m pytest -q -p no:cacheprovider --timeout 900 tests/vllm

## Spec conformance and the fuzzing run; FUZZ_EXAMPLES=500 for a longer one.
conformance: $(STAMP) engines
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/conformance

BENCH_STAMP := $(VENV)/.installed-bench

$(BENCH_STAMP): $(STAMP)
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[dev,bench]'
	@touch $(BENCH_STAMP)

## Benchmarks (not in CI); results go to docs/benchmarks.md and docs/img/.
bench: bench-peers bench-routing

## This router against LiteLLM, vllm-router and sglang-router on the same simulators.
bench-peers: $(BENCH_STAMP)
	$(BIN)/python -m bench.peers $(ARGS)

## Routing quality on a simulated fleet of four unlike engines (under 15 minutes).
bench-routing: $(BENCH_STAMP)
	$(BIN)/python -m bench.routing $(ARGS)

## Router overhead against a bare aiohttp proxy.
bench-overhead: $(STAMP)
	$(BIN)/python -m bench.overhead $(ARGS)

## Routers sharing limits through Valkey: the sync cost, one round, sites of 1-3 (about 7 minutes), then bench-site-scale.
bench-site: $(BENCH_STAMP)
	$(BIN)/python -m bench.site $(ARGS)
	$(BIN)/python -m bench.site_scale

## One sync round at 10 to 100,000 active keys, one primary and a cluster of 3+3 (about 4 minutes).
bench-site-scale: $(BENCH_STAMP)
	$(BIN)/python -m bench.site_scale $(ARGS)

## The gateway stages' CPU per request (on against off) and a deduplicated burst (about 6 minutes).
bench-gateway: $(BENCH_STAMP)
	$(BIN)/python -m bench.gateway $(ARGS)

## Good requests' throughput when one in ten is bad, at 256 connections, in alternating 3 s cells (about 2.5 minutes).
bench-bad-input: $(STAMP)
	$(BIN)/python -m bench.badinput $(ARGS)

## Good requests' rate and latency while clients send 10 MiB bodies built to be slow (about a minute).
bench-heavy-body: $(STAMP)
	$(BIN)/python -m bench.heavybody $(ARGS)

## The router's and the agent's memory per stream in flight, 0 to 1,000 streams held (about 2 minutes).
bench-stream-memory: $(STAMP)
	$(BIN)/python -m bench.stream_memory $(ARGS)

## One million requests; memory must stay flat and nothing held (about 10 minutes).
soak: $(STAMP)
	$(BIN)/python -m bench.soak $(ARGS)

## Every token billed once under faults: a site of 3 routers, Valkey with Sentinel, PostgreSQL,
## 1,200 requests of 20 tenants while processes are killed (about 2 minutes); the table goes to
## build/check-accounting.md. `make test` runs a short version (tests/integration/test_accounting.py).
check-accounting: $(STAMP)
	$(BIN)/python scripts/check_accounting.py $(ARGS)

docs: $(STAMP)
	$(BIN)/python scripts/gen_config_docs.py
	$(BIN)/python scripts/gen_policy_schema.py

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .ruff_cache
