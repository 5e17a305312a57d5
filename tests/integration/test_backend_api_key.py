"""An engine started with --api-key (the simulator's, which refuses every request without
`Authorization: Bearer KEY`, health checks and metrics included): the agent checks its
health, discovers its model, scrapes its metrics and forwards requests with the key, and
the key shows up in no log."""

from __future__ import annotations

from pathlib import Path

import httpx2 as httpx
import pytest

from tests.procs import (
    ADMIN_KEY,
    Cluster,
    Proc,
    Router,
    Sim,
    wait_registered,
    wait_until,
)

MODEL = "keyed-model"
KEY = "sk-engine-7d41e0c2b9"
BEARER = {"Authorization": f"Bearer {KEY}"}


def keyed_sim(c: Cluster) -> Sim:
    return c.sim(MODEL, "--zero-latency", api_key=KEY)


def refusals(sim: Sim) -> int:
    return sim.proc.log().count("no valid API key")


def engine_snapshot(router: Router) -> dict[str, object] | None:
    table = httpx.get(
        router.url + "/admin/routing-table",
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
        timeout=5,
    ).json()
    for agent in table["agents"]:
        if agent["metadata"]["model"] == MODEL and agent["engine"]:
            snapshot: dict[str, object] = agent["engine"]
            return snapshot
    return None


def assert_key_not_logged(*procs: Proc) -> None:
    for proc in procs:
        assert KEY not in proc.log(), f"the backend key leaked into the {proc.name} log"


def test_the_agent_uses_the_key_from_a_file(make_cluster: Cluster, tmp_path: Path) -> None:
    c = make_cluster
    router = c.router()
    sim = keyed_sim(c)
    key_file = tmp_path / "backend.key"
    key_file.write_text(KEY + "\n")
    # No --model: the model comes from /v1/models, which needs the key too.
    agent = c.agent(router, sim, "--backend-api-key-file", str(key_file), "--log-level", "debug")
    wait_registered(router, MODEL)
    with router.openai() as client:
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5
        )
        assert reply.usage is not None and reply.usage.completion_tokens > 0
        chunks = list(
            client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=5,
                stream=True,
            )
        )
        assert any(chunk.choices and chunk.choices[0].delta.content for chunk in chunks)
    # The engine's metrics reached the router: the scrapes carried the key as well.
    wait_until(lambda: (engine_snapshot(router) or {}).get("generation_tokens_total"))
    assert refusals(sim) == 0
    # The simulator does refuse a request without the key.
    assert httpx.get(sim.url + "/health", timeout=5).status_code == 401
    assert refusals(sim) == 1
    assert_key_not_logged(agent, router.proc)


def test_the_key_from_the_environment_and_an_agent_without_one(
    make_cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    c = make_cluster
    router = c.router()
    sim = keyed_sim(c)
    keyless = c.agent(router, sim, "--model", MODEL, name="keyless")
    monkeypatch.setenv("HIVENET_AGENT_BACKEND_API_KEY", KEY)
    keyed = c.agent(router, sim, "--model", MODEL, "--log-level", "debug", name="keyed")
    wait_registered(router, MODEL)
    with router.openai() as client:
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5
        )
        assert reply.usage is not None
    # The agent without the key never gets past the engine's health check, and says why.
    wait_until(lambda: "waiting for the backend" in keyless.log())
    wait_until(lambda: "HTTP 401 (check --backend-api-key-file)" in keyless.log())
    assert refusals(sim) >= 1
    assert "registered with router" not in keyless.log()
    assert router.healthy_replicas(MODEL) == 1
    assert_key_not_logged(keyed, keyless, router.proc)


def test_an_unreadable_key_file_stops_the_agent_at_start(
    make_cluster: Cluster, tmp_path: Path
) -> None:
    c = make_cluster
    router = c.router()
    missing = tmp_path / "no-such.key"
    agent = c.agent(
        router, None, "--backend-api-key-file", str(missing), backend_url="http://127.0.0.1:9"
    )
    assert agent.popen is not None and agent.popen.wait(timeout=20) == 2
    assert f"cannot read --backend-api-key-file {missing}" in agent.log()
