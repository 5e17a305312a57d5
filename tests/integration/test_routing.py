"""Selection, waiting, retries and queue limits, through real processes."""

from __future__ import annotations

import asyncio

import httpx2 as httpx
import openai
import pytest

from tests.procs import Cluster, metric, wait_registered

MODEL = "m"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def _served(sim_metrics: str) -> float:
    return metric(sim_metrics, "vllm:request_success_total")


def test_least_loaded_keeps_one_at_a_time_on_one_agent(make_cluster: Cluster) -> None:
    router = make_cluster.router()
    sims = [make_cluster.sim(MODEL, "--zero-latency", name=f"sim{i}") for i in range(2)]
    for i, sim in enumerate(sims):
        make_cluster.agent(router, sim, name=f"agent{i}")
    wait_registered(router, MODEL, replicas=2)
    with router.openai() as client:
        for _ in range(6):
            client.chat.completions.create(**CHAT)  # type: ignore[call-overload]
    # Both agents are idle at every choice, so the one that served last serves again.
    assert sorted(_served(s.metrics()) for s in sims) == [0.0, 6.0]


async def test_concurrent_requests_balance_by_load(make_cluster: Cluster) -> None:
    router = make_cluster.router()
    sims = [make_cluster.sim(MODEL, "--ttft-base", "300ms", name=f"sim{i}") for i in range(2)]
    for i, sim in enumerate(sims):
        make_cluster.agent(router, sim, name=f"agent{i}")
    wait_registered(router, MODEL, replicas=2)
    async with openai.AsyncOpenAI(
        base_url=router.url + "/v1", api_key="x", max_retries=0
    ) as client:
        await asyncio.gather(*(client.chat.completions.create(**CHAT) for _ in range(8)))
    assert [_served(s.metrics()) for s in sims] == [4.0, 4.0]


async def test_wait_queue_holds_requests_until_a_slot_frees(make_cluster: Cluster) -> None:
    router = make_cluster.router()
    sim = make_cluster.sim(MODEL, "--ttft-base", "200ms")
    make_cluster.agent(router, sim, "--capacity", "1")
    wait_registered(router, MODEL)
    async with openai.AsyncOpenAI(
        base_url=router.url + "/v1", api_key="x", max_retries=0
    ) as client:
        replies = await asyncio.gather(*(client.chat.completions.create(**CHAT) for _ in range(3)))
    assert all(r.choices[0].message.content for r in replies)
    text = router.metrics()
    assert metric(text, "hivenet_queue_wait_seconds_count", model=MODEL) == 2.0
    assert metric(text, "hivenet_queue_depth", model=MODEL) == 0.0


async def test_full_agents_without_wait_queue_give_no_capacity(make_cluster: Cluster) -> None:
    router = make_cluster.router("--queue-depth", "0")
    sim = make_cluster.sim(MODEL, "--ttft-base", "500ms")
    make_cluster.agent(router, sim, "--capacity", "1")
    wait_registered(router, MODEL)
    async with httpx.AsyncClient(base_url=router.url, timeout=10) as client:
        replies = await asyncio.gather(
            *(client.post("/v1/chat/completions", json=CHAT) for _ in range(2))
        )
    statuses = sorted(r.status_code for r in replies)
    assert statuses == [200, 503]
    refused = next(r for r in replies if r.status_code == 503)
    assert refused.json()["error"]["code"] == "no_capacity"


def test_retries_skip_a_failing_agent(make_cluster: Cluster) -> None:
    router = make_cluster.router()
    bad = make_cluster.sim(MODEL, "--zero-latency", "--fault-error-rate", "1", name="bad")
    good = make_cluster.sim(MODEL, "--zero-latency", name="good")
    # The failing agent registers first: of agents that have not served yet, the first to
    # join is chosen first. Its failure makes it the last choice after that.
    make_cluster.agent(router, bad, name="agent-bad")
    wait_registered(router, MODEL)
    make_cluster.agent(router, good, name="agent-good")
    wait_registered(router, MODEL, replicas=2)
    with httpx.Client(base_url=router.url, timeout=10) as client:
        for _ in range(4):
            reply = client.post("/v1/chat/completions", json=CHAT)
            assert reply.status_code == 200, reply.text
    assert _served(good.metrics()) == 4.0
    assert metric(bad.metrics(), "hivenet_sim_requests_total") >= 1.0


def test_backend_error_on_the_only_agent_is_reported(make_cluster: Cluster) -> None:
    router = make_cluster.router()
    sim = make_cluster.sim(MODEL, "--zero-latency", "--fault-error-rate", "1")
    make_cluster.agent(router, sim)
    wait_registered(router, MODEL)
    reply = httpx.post(router.url + "/v1/chat/completions", json=CHAT, timeout=10)
    assert reply.status_code == 503
    error = reply.json()["error"]
    assert error["code"] == "no_agents_available"
    # The engine's own words are for the operator's log, not the client.
    assert error["message"].endswith("last failure: backend_error")
    assert "simulated engine failure" in router.proc.log()


def test_request_errors_are_not_retried(make_cluster: Cluster) -> None:
    router = make_cluster.router()
    sims = [
        make_cluster.sim(MODEL, "--zero-latency", "--max-model-len", "64", name=f"sim{i}")
        for i in range(2)
    ]
    for i, sim in enumerate(sims):
        make_cluster.agent(router, sim, name=f"agent{i}")
    wait_registered(router, MODEL, replicas=2)
    body = {**CHAT, "max_tokens": 1000}
    reply = httpx.post(router.url + "/v1/chat/completions", json=body, timeout=10)
    assert reply.status_code == 400
    assert reply.json()["error"]["code"] == "context_length_exceeded"
    attempts = sum(metric(s.metrics(), "hivenet_sim_requests_total") for s in sims)
    assert attempts == 1.0


async def test_global_queue_full(make_cluster: Cluster) -> None:
    router = make_cluster.router(
        "--max-concurrent", "1", "--queue-size", "1", "--enqueue-timeout", "200ms"
    )
    sim = make_cluster.sim(MODEL, "--ttft-base", "1s")
    make_cluster.agent(router, sim)
    wait_registered(router, MODEL)
    async with httpx.AsyncClient(base_url=router.url, timeout=10) as client:
        replies = await asyncio.gather(
            *(client.post("/v1/chat/completions", json=CHAT) for _ in range(3))
        )
    codes = sorted(r.status_code for r in replies)
    assert codes == [200, 200, 503]
    full = next(r for r in replies if r.status_code == 503)
    assert full.json()["error"]["code"] == "queue_full"


def test_deadline_gives_request_timeout_and_frees_everything(make_cluster: Cluster) -> None:
    router = make_cluster.router("--request-timeout", "700ms")
    sim = make_cluster.sim(MODEL, "--fault-hang-rate", "1")
    make_cluster.agent(router, sim)
    wait_registered(router, MODEL)
    reply = httpx.post(router.url + "/v1/chat/completions", json=CHAT, timeout=10)
    assert reply.status_code == 504
    assert reply.json()["error"]["code"] == "request_timeout"
    text = router.metrics()
    assert metric(text, "hivenet_router_active_forwards") == 0.0
    assert metric(text, "hivenet_agent_capacity_utilization") == 0.0


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/messages"])
def test_max_stream_duration_ends_a_stream_with_an_error_event(
    make_cluster: Cluster, route: str
) -> None:
    # 50 tokens at 100 ms each take 5 s: the 800 ms limit ends the stream well before.
    router = make_cluster.router("--request-timeout", "500ms", "--max-stream-duration", "800ms")
    sim = make_cluster.sim(MODEL, "--itl", "100ms", "--ttft-base", "0")
    make_cluster.agent(router, sim)
    wait_registered(router, MODEL)
    body = {**CHAT, "max_tokens": 50, "stream": True}
    with httpx.stream("POST", router.url + route, json=body, timeout=10) as reply:
        assert reply.status_code == 200
        text = reply.read().decode()
    assert "--max-stream-duration (0.8s)" in text and '"request_timeout"' in text
    assert "[DONE]" not in text and "message_stop" not in text
    assert metric(router.metrics(), "hivenet_router_active_forwards") == 0.0
