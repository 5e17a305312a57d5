"""One meter for every answer, through real processes: a router with client keys, a daily
budget and a wallet on a real PostgreSQL, an agent on the simulator (which writes its own
count of every request, --usage-log), the official OpenAI SDK as the client.

A stream whose client did not ask for usage is still billed the engine's exact count: the
router asks the engine for it (`stream_options.include_usage`) and keeps the usage event
from the client (docs/admission.md, "One meter")."""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx2 as httpx
import openai
import orjson
import pytest

from tests.postgres import Postgres, postgres_server
from tests.procs import ADMIN_KEY, Cluster, Router, cluster, metric, wait_until

MODEL = "metered"
PLAIN = "unasked"
KEY = "sk-hivenet-meter-client-0123"
PROMPT = [{"role": "user", "content": "Count every token once."}]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Router, Path, Postgres]]:
    tmp: Path = tmp_path_factory.mktemp("meter")
    with postgres_server() as pg, cluster(tmp) as c:
        auth = tmp / "auth.yaml"
        auth.write_text(
            "api:\n  mode: api-key\n  keys:\n"
            f'    - key_hash: "{hashlib.sha256(KEY.encode()).hexdigest()}"\n'
            "      metadata: {name: k-acme, owner: acme}\n"
            "      quota: {tokens_per_day: 1000000}\n"
            "admin:\n  mode: api-key\n"
        )
        policy = tmp / "policy.yaml"
        policy.write_text(
            "prices: {input_per_million: 1000, output_per_million: 2000}\n"
            "routing_policy: {strategy: least-loaded}\n"
        )
        router = c.router(
            "--ledger-dsn", pg.dsn(), "--auth-config-file", str(auth),
            "--policy-file", str(policy),
        )  # fmt: skip
        log = tmp / "usage.jsonl"
        sim = c.sim(MODEL, "--zero-latency", "--usage-log", str(log))
        c.agent(router, sim)
        # An engine the router does not ask for usage (any OpenAI-compatible server).
        plain = c.sim(PLAIN, "--zero-latency", "--usage-log", str(log), name="plain")
        c.agent(router, plain, "--engine", "openai", name="agent-plain")
        wait_until(lambda: metric(router.metrics(), "hivenet_routing_agent_healthy") == 2.0)
        wait_until(lambda: metric(router.metrics(), "hivenet_ledger_up") == 1.0, timeout=10)
        credited = admin(router, "POST", "/admin/wallets/acme/credit", {"amount": "100"})
        assert credited.status_code == 200, credited.text
        yield router, log, pg


def admin(router: Router, method: str, path: str, body: Any = None) -> httpx.Response:
    return httpx.request(
        method,
        router.url + path,
        json=body,
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
        timeout=10,
    )


def engine_count(log: Path, request_id: str) -> dict[str, Any]:
    """The simulator's own count of one request (its usage log)."""
    found: list[dict[str, Any]] = []

    def logged() -> bool:
        found[:] = [
            line
            for raw in (log.read_bytes().splitlines() if log.exists() else [])
            if (line := orjson.loads(raw))["request_id"] == request_id
        ]
        return bool(found)

    wait_until(logged, timeout=5)
    (line,) = found
    return line


def audit_of(router: Router, request_id: str) -> dict[str, Any]:
    found: list[dict[str, Any]] = []
    wait_until(
        lambda: bool(
            found.extend(r for r in router.audit_records() if r["request_id"] == request_id)
            or found
        ),
        timeout=5,
    )
    return found[0]


def daily_used(router: Router) -> int:
    budgets = admin(router, "GET", "/admin/usage").json()["budgets"]
    return sum(int(b["tokens_used"]) for b in budgets if b["tenant"] == "acme")


def output_series(router: Router) -> float:
    return metric(router.metrics(), "hivenet_tenant_output_tokens_total", tenant_id="acme") or 0.0


def agent_series(router: Router) -> float:
    value = metric(router.metrics(), "hivenet_agent_output_tokens_total")
    assert value is not None
    return value


def ledger_tokens(pg: Postgres, request_id: str) -> tuple[int, int, Decimal]:
    def charged() -> str:
        return pg.psql(
            "SELECT input_tokens, output_tokens, -amount FROM ledger"  # noqa: S608
            f" WHERE kind = 'charge' AND request_id = '{request_id}'"
        )

    wait_until(lambda: bool(charged()), timeout=10)
    tokens_in, tokens_out, amount = charged().split("|")
    return int(tokens_in), int(tokens_out), Decimal(amount)


def client(router: Router, request_id: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=router.url + "/v1",
        api_key=KEY,
        max_retries=0,
        default_headers={"X-Request-ID": request_id},
    )


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_a_stream_without_include_usage_is_billed_the_engines_count(
    fleet: tuple[Router, Path, Postgres], route: str
) -> None:
    router, log, pg = fleet
    rid = str(uuid.uuid4())
    before_daily, before_series = daily_used(router), output_series(router)
    before_agent = agent_series(router)
    with client(router, rid) as oai:
        if route == "chat":
            chunks = list(
                oai.chat.completions.create(
                    model=MODEL, messages=PROMPT, max_tokens=50, stream=True
                )
            )
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            chunks = list(
                oai.completions.create(model=MODEL, prompt="Count.", max_tokens=50, stream=True)
            )
            text = "".join(c.choices[0].text for c in chunks if c.choices)
    # As before: the client that did not ask gets no usage, and no chunk without choices.
    assert text
    assert all(c.usage is None and c.choices for c in chunks)
    engine = engine_count(log, rid)
    assert engine["stream"] is True and engine["completion_tokens"] == 50
    exact = (engine["prompt_tokens"], engine["completion_tokens"])
    record = audit_of(router, rid)
    assert (record["input_tokens"], record["output_tokens"]) == exact
    tokens_in, tokens_out, amount = ledger_tokens(pg, rid)
    assert (tokens_in, tokens_out) == exact
    assert amount == exact[0] * Decimal("0.001") + exact[1] * Decimal("0.002")
    assert record["charge"] == str(amount)
    wait_until(lambda: output_series(router) == before_series + exact[1])
    assert agent_series(router) == before_agent + exact[1]
    assert daily_used(router) == before_daily + sum(exact)


def test_a_client_that_asks_for_usage_gets_it_once(
    fleet: tuple[Router, Path, Postgres],
) -> None:
    router, log, _ = fleet
    rid = str(uuid.uuid4())
    with client(router, rid) as oai:
        chunks = list(
            oai.chat.completions.create(
                model=MODEL,
                messages=PROMPT,
                max_tokens=20,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
    usage = [c.usage for c in chunks if c.usage is not None]
    assert len(usage) == 1
    engine = engine_count(log, rid)
    assert (usage[0].prompt_tokens, usage[0].completion_tokens) == (
        engine["prompt_tokens"],
        engine["completion_tokens"],
    )
    record = audit_of(router, rid)
    assert record["output_tokens"] == engine["completion_tokens"] == 20


def test_a_cached_stream_is_billed_the_engines_count_and_keeps_usage_from_the_client(
    make_cluster: Cluster, tmp_path: Path
) -> None:
    """The cache and its followers keep the stream as the engine sent it, usage included:
    each reader is metered exactly, and each client that did not ask gets no usage."""
    policies = tmp_path / "policies"
    policies.mkdir()
    (policies / "cached.yaml").write_text(
        "models: [cached]\nrouting_policy: {strategy: least-loaded}\nresponse_cache: {}\n"
    )
    auth = tmp_path / "auth.yaml"
    auth.write_text(
        "api:\n  mode: api-key\n  keys:\n"
        f'    - key_hash: "{hashlib.sha256(KEY.encode()).hexdigest()}"\n'
        "      metadata: {name: k-acme, owner: acme}\n"
        "      quota: {tokens_per_day: 1000000}\n"
        "admin:\n  mode: api-key\n"
    )
    router = make_cluster.router(
        "--policy-model-dir", str(policies), "--auth-config-file", str(auth)
    )
    log = tmp_path / "usage.jsonl"
    sim = make_cluster.sim("cached", "--zero-latency", "--usage-log", str(log))
    make_cluster.agent(router, sim)
    wait_until(lambda: metric(router.metrics(), "hivenet_routing_agent_healthy") == 1.0)
    ids = [str(uuid.uuid4()), str(uuid.uuid4())]
    for rid in ids:
        with client(router, rid) as oai:
            chunks = list(
                oai.chat.completions.create(
                    model="cached", messages=PROMPT, max_tokens=30, stream=True, temperature=0
                )
            )
        assert chunks and all(c.usage is None and c.choices for c in chunks)
        # The answer is stored when the first request closes, after its client has it all.
        wait_until(lambda: metric(router.metrics(), "hivenet_cache_entries") == 1.0)
    engine = engine_count(log, ids[0])  # one engine call: the second was a hit
    exact = (engine["prompt_tokens"], engine["completion_tokens"])
    for rid in ids:
        record = audit_of(router, rid)
        assert (record["input_tokens"], record["output_tokens"]) == exact
    assert len(log.read_bytes().splitlines()) == 1


def test_an_engine_not_asked_for_usage_is_counted_from_the_text_relayed(
    fleet: tuple[Router, Path, Postgres],
) -> None:
    """The body reaches such an engine unchanged, and its stream the client unchanged; the
    answer is counted from its text (4 bytes a token before any stream taught the ratio),
    not one token per data line."""
    router, log, _ = fleet
    rid = str(uuid.uuid4())
    with client(router, rid) as oai:
        chunks = list(
            oai.chat.completions.create(model=PLAIN, messages=PROMPT, max_tokens=40, stream=True)
        )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    engine = engine_count(log, rid)
    assert engine["completion_tokens"] == 40 and len(chunks) >= 40
    record = audit_of(router, rid)
    assert record["output_tokens"] == -(-len(text.encode()) // 4)
