"""The gateway stages together, through real processes: wallets on a real PostgreSQL with
the stream validator and with the response cache, the start-up check of prices, and
`make run-wallets`."""

from __future__ import annotations

import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx2 as httpx
import orjson
import pytest
import yaml

from tests.integration.test_dashboards import promtool
from tests.postgres import Postgres, postgres_server
from tests.procs import ADMIN_KEY, Cluster, Router, metric, wait_registered, wait_until

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "deploy" / "prometheus" / "alerts-gateway.yml"
# Series only a router of a site has (the shared cache's store calls).
SITE_ONLY = {"hivenet_cache_store_errors_total"}
MODEL = "m"
PRICES = "prices: {input_per_million: 1000, output_per_million: 2000}\n"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
LOCAL_TOKENS = 40
CLOUD_TOKENS = 12


@pytest.fixture
def pg() -> Iterator[Postgres]:
    with postgres_server() as server:
        yield server


def credit(router: Router, amount: str, tenant: str = "default") -> None:
    def done() -> bool:
        reply = httpx.post(
            f"{router.url}/admin/wallets/{tenant}/credit",
            json={"amount": amount},
            headers=ADMIN,
            timeout=5,
        )
        return reply.status_code == 200

    wait_until(done, timeout=15)  # the ledger connects in the background


def charges(router: Router, tenant: str = "default") -> list[dict[str, Any]]:
    reply = httpx.get(
        f"{router.url}/admin/wallets/{tenant}/ledger?limit=500", headers=ADMIN, timeout=5
    )
    assert reply.status_code == 200, reply.text
    return [e for e in reply.json()["entries"] if e["kind"] == "charge"]


def audit(router: Router, request_ids: set[str]) -> dict[str, dict[str, Any]]:
    assert router.audit is not None
    path = router.audit
    found: dict[str, dict[str, Any]] = {}

    def written() -> bool:
        found.clear()
        if path.exists():
            for line in path.read_bytes().splitlines():
                record = orjson.loads(line)
                if record["request_id"] in request_ids:
                    found[record["request_id"]] = record
        return len(found) == len(request_ids)

    wait_until(written, timeout=5)
    return found


def reconciled(router: Router) -> bool:
    reply = httpx.get(f"{router.url}/admin/ledger/reconcile", headers=ADMIN, timeout=5)
    assert reply.status_code == 200, reply.text
    return bool(reply.json()["ok"])


def test_an_unpriced_model_stops_a_router_with_wallets(
    make_cluster: Cluster, tmp_path: Path, pg: Postgres
) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text("routing_policy: {strategy: least-loaded}\n")
    log = make_cluster.refused_router(
        *("--ledger-dsn", pg.database(), "--policy-file", str(policy)),
        env={"HIVENET_ROUTER_ADMIN_API_KEYS": ADMIN_KEY},
    )
    assert "without a price" in log and "default" in log
    assert pg.dsn() not in log


def test_a_malformed_ledger_dsn_stops_the_router_without_showing_its_password(
    make_cluster: Cluster,
) -> None:
    log = make_cluster.refused_router(
        "--ledger-dsn",
        "postgresql://billing:hunter2-secret@db:notaport/wallets",
        env={"HIVENET_ROUTER_ADMIN_API_KEYS": ADMIN_KEY},
    )
    assert "ledger" in log.lower()
    assert "hunter2-secret" not in log


def test_loops_replaced_by_the_provider_are_billed_as_the_provider_answered(
    make_cluster: Cluster, tmp_path: Path, pg: Postgres
) -> None:
    """The validator's failed local attempts never reach the ledger: each request has one
    charge, for the tokens of the answer the client received."""
    policies = tmp_path / "policies"
    policies.mkdir()
    (policies / "m.yaml").write_text(
        f"models: [{MODEL}]\n{PRICES}routing_policy: {{strategy: least-loaded, max_tries: 1}}\n"
        "circuit_breaker: {enabled: false}\nstream_validator: {}\n"
        "fallback_provider: {engine: openai, model: cloud-model}\n"
    )
    (policies / "_default.yaml").write_text(PRICES + "routing_policy: {strategy: least-loaded}\n")
    cloud = make_cluster.sim(
        "cloud-model", "--zero-latency", "--answer-cap", str(CLOUD_TOKENS), name="cloud"
    )
    router = make_cluster.router(
        *("--policy-model-dir", str(policies), "--ledger-dsn", pg.database()),
        env={"HIVENET_ROUTER_OPENAI_API_KEY": "k", "HIVENET_ROUTER_OPENAI_BASE_URL": cloud.url},
    )
    local = make_cluster.sim(
        MODEL, "--itl", "2ms", "--ttft-base", "0s", "--fault-repeat-rate", "0.4", name="local"
    )
    make_cluster.agent(router, local)
    wait_registered(router, MODEL)
    credit(router, "100")
    ids: set[str] = set()
    with router.openai() as client:
        for index in range(16):
            rid = str(uuid.uuid4())
            ids.add(rid)
            stream = client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": f"question {index}"}],
                max_tokens=LOCAL_TOKENS,
                stream=True,
                stream_options={"include_usage": True},
                extra_headers={"X-Request-ID": rid},
            )
            text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            assert " over and over" not in text
    records = audit(router, ids)
    replaced = [r for r in records.values() if r.get("replaced") == "degenerate"]
    assert replaced, "no local answer looped: raise the repeat rate"
    wait_until(lambda: len([c for c in charges(router) if c["request_id"] in ids]) == len(ids))
    billed = {c["request_id"]: c for c in charges(router) if c["request_id"] in ids}
    assert sorted(billed) == sorted(ids)  # one charge per request, none for the loops
    for rid, record in records.items():
        charge = billed[rid]
        assert (charge["input_tokens"], charge["output_tokens"]) == (
            record["input_tokens"],
            record["output_tokens"],
        )
        assert Decimal(record["charge"]) == -Decimal(charge["amount"])
    for record in replaced:
        assert record["output_tokens"] == CLOUD_TOKENS
    assert reconciled(router)


@pytest.mark.parametrize("bill_hits", [True, False])
def test_a_cache_hit_is_billed_as_the_policy_says(
    make_cluster: Cluster, tmp_path: Path, pg: Postgres, bill_hits: bool
) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        PRICES + "routing_policy: {strategy: least-loaded}\n"
        f"response_cache: {{bill_hits: {str(bill_hits).lower()}}}\n"
    )
    router = make_cluster.router("--policy-file", str(policy), "--ledger-dsn", pg.database())
    make_cluster.agent(router, make_cluster.sim(MODEL, "--zero-latency"))
    wait_registered(router, MODEL)
    credit(router, "10")
    first, second = str(uuid.uuid4()), str(uuid.uuid4())
    with router.openai() as client:
        for rid in (first, second):
            client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "the same question"}],
                max_tokens=8,
                temperature=0,
                extra_headers={"X-Request-ID": rid},
            )
    records = audit(router, {first, second})
    assert "cache" not in records[first] and records[second]["cache"] == "hit"
    wait_until(lambda: {first, second} <= {c["request_id"] for c in charges(router)})
    billed = {c["request_id"]: Decimal(c["amount"]) for c in charges(router)}
    assert billed[first] < 0
    assert billed[second] == (billed[first] if bill_hits else 0)
    assert records[second].get("billed", True) is bill_hits
    assert reconciled(router)
    exported = router.metrics()
    assert metric(exported, "hivenet_cache_requests_total", result="hit") == 1.0
    # every series the gateway's alert rules read exists on a router with the stages on
    for rule in yaml.safe_load(ALERTS.read_text())["groups"][0]["rules"]:
        for name in set(re.findall(r"\bhivenet_\w+", rule["expr"])) - SITE_ONLY:
            assert metric(exported, name) is not None, f"{rule['alert']} reads missing {name}"


def test_promtool_accepts_the_gateway_rules() -> None:
    promtool("check", "rules", str(ALERTS))


def test_make_run_wallets_serves_and_charges() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "run_wallets.py"), "--duration", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "with wallets is ready" in done.stdout
