"""The order of the request stages through real processes (docs/admission.md): the request
rate comes right after authentication, before the wallet, the cache and admission, so cache
hits and requests that follow an identical one in flight count toward it, and a request
refused for its rate never reaches the ledger."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx2 as httpx
import orjson
import pytest

from tests.postgres import Postgres, postgres_server
from tests.procs import Cluster, Router, metric, wait_until

MODEL = "m"
KEY = "sk-order-acme-0123456789"
BODY = {
    "model": MODEL,
    "temperature": 0,
    "max_tokens": 8,
    "messages": [{"role": "user", "content": "the same question"}],
}


@pytest.fixture
def pg() -> Iterator[Postgres]:
    with postgres_server() as server:
        yield server


def start(
    cluster: Cluster,
    tmp: Path,
    policy: str,
    *extra: str,
    sim: tuple[str, ...] = ("--zero-latency",),
) -> Router:
    """A router whose one key has `requests_per_minute: 3`, one simulator behind an agent."""
    (tmp / "policy.yaml").write_text(policy + "routing_policy: {strategy: least-loaded}\n")
    auth = tmp / "auth.yaml"
    auth.write_text(
        "api:\n  mode: api-key\n  keys:\n"
        f'    - key_hash: "{hashlib.sha256(KEY.encode()).hexdigest()}"\n'
        "      metadata: {name: k, owner: acme}\n"
        "      quota: {requests_per_minute: 3}\n"
        "admin:\n  mode: api-key\n"
    )
    router = cluster.router(
        "--policy-file", str(tmp / "policy.yaml"), "--auth-config-file", str(auth), *extra
    )
    cluster.agent(router, cluster.sim(MODEL, *sim))
    wait_until(lambda: metric(router.metrics(), "hivenet_routing_agent_healthy") == 1.0)
    return router


def post(router: Router) -> httpx.Response:
    return httpx.post(
        router.url + "/v1/chat/completions",
        content=orjson.dumps(BODY),
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
        timeout=20,
    )


def test_cache_hits_count_toward_the_request_rate(make_cluster: Cluster, tmp_path: Path) -> None:
    router = start(make_cluster, tmp_path, "response_cache: {}\n")
    replies = [post(router) for _ in range(6)]
    assert [reply.status_code for reply in replies] == [200] * 3 + [429] * 3
    assert [reply.headers.get("x-hivenet-cache") for reply in replies[:3]] == [
        "miss",
        "hit",
        "hit",
    ]
    refused = replies[3].json()["error"]
    assert refused["code"] == "rate_limit_exceeded" and replies[3].headers["retry-after"] == "20"


def test_requests_that_follow_an_identical_one_in_flight_count_toward_the_rate(
    make_cluster: Cluster, tmp_path: Path
) -> None:
    """Six identical requests at once, deduplication only: whichever three the rate lets
    through share one engine call, the other three are refused, however they overlap."""
    slow = ("--ttft-base", "1s", "--output-tokens", "4")
    router = start(make_cluster, tmp_path, "response_cache: {store: false}\n", sim=slow)
    barrier = threading.Barrier(6)

    def together(_: int) -> httpx.Response:
        barrier.wait(timeout=10)
        return post(router)

    with ThreadPoolExecutor(6) as pool:
        replies = list(pool.map(together, range(6)))
    assert sorted(reply.status_code for reply in replies) == [200] * 3 + [429] * 3
    served = [reply.headers.get("x-hivenet-cache") for reply in replies if reply.is_success]
    assert "dedup" in served  # they did overlap: some followed the first


def test_a_request_past_its_rate_never_reaches_the_ledger(
    make_cluster: Cluster, tmp_path: Path, pg: Postgres
) -> None:
    """The key has no wallet: a request the rate lets through is refused by the wallet
    (402, one lookup in the ledger); one past the rate is refused before it (429), and the
    ledger is not asked again."""
    router = start(
        make_cluster,
        tmp_path,
        "prices: {input_per_million: 1000, output_per_million: 2000}\n",
        "--ledger-dsn",
        pg.dsn(),
    )
    wait_until(lambda: metric(router.metrics(), "hivenet_ledger_up") == 1.0, timeout=10)
    statuses = [post(router).status_code for _ in range(5)]
    assert statuses == [402] * 3 + [429] * 2
    assert metric(router.metrics(), "hivenet_wallet_refused_total", reason="no_wallet") == 3
