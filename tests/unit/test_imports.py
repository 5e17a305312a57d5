"""What each process loads at start: what a deployment does not use stays out of memory.

A router without --ledger-dsn never loads the PostgreSQL driver, one without
--sync-store=valkey never loads the Valkey client, and the agent loads none of the router's
request path (policies, auth, Prometheus). Each was once pulled in by an import at the top
of a shared module and cost several MiB per process (bench-peers, peak memory).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def loaded(module: str) -> set[str]:
    code = f"import sys, json; import {module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, check=True, text=True)
    return set(json.loads(out.stdout))


@pytest.mark.parametrize(
    ("module", "absent"),
    [
        ("hivenet_router.router.process", ("asyncpg", "valkey", "opentelemetry")),
        (
            "hivenet_router.agent.process",
            (
                "aiohttp",
                "prometheus_client",
                "yaml",
                "hivenet_router.policy",
                "hivenet_router.auth",
                "opentelemetry",
                "grpc",
            ),
        ),
    ],
)
def test_a_process_loads_nothing_it_does_not_use(module: str, absent: tuple[str, ...]) -> None:
    modules = loaded(module)
    assert module in modules  # the import itself happened
    for name in absent:
        assert name not in modules, f"{module} loads {name}"
