"""Streams past --request-timeout: the deadline bounds the answer's head; a stream then runs
while chunks keep coming (--stream-idle-timeout) up to --max-stream-duration."""

from __future__ import annotations

import httpx2 as httpx

from tests.procs import Cluster, metric, wait_registered, wait_until

MODEL = "m"
# 10,000 tokens at 1 ms each last at least 10 s, however fast the machine: five times the
# 2 s --request-timeout below.
TOKENS = 10_000
LONG = ("--itl", "1ms", "--ttft-base", "0", "--max-model-len", "20000")


def _chat(max_tokens: int) -> dict[str, object]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "tell me everything"}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def _freed(router_metrics: str, sim_metrics: str) -> bool:
    return (
        metric(router_metrics, "hivenet_router_active_forwards") == 0.0
        and metric(router_metrics, "hivenet_agent_capacity_utilization") == 0.0
        and metric(sim_metrics, "vllm:num_requests_running") == 0.0
    )


def test_a_stream_outlives_the_request_timeout(make_cluster: Cluster) -> None:
    router = make_cluster.router("--request-timeout", "2s", "--stream-idle-timeout", "5s")
    sim = make_cluster.sim(MODEL, *LONG)
    make_cluster.agent(router, sim)
    wait_registered(router, MODEL)
    with router.openai() as client:
        stream = client.chat.completions.create(**_chat(TOKENS))  # type: ignore[call-overload]
        pieces, usage = 0, None
        for event in stream:
            if event.choices and event.choices[0].delta.content:
                pieces += 1
            usage = event.usage or usage
    assert usage is not None and usage.completion_tokens == TOKENS
    assert pieces == TOKENS
    assert float(metric(sim.metrics(), "vllm:generation_tokens_total") or 0) >= TOKENS
    wait_until(lambda: _freed(router.metrics(), sim.metrics()))


def test_a_stalled_stream_ends_after_the_idle_timeout(make_cluster: Cluster) -> None:
    router = make_cluster.router("--request-timeout", "5s", "--stream-idle-timeout", "1s")
    # The engine stops sending halfway through and never ends the stream.
    sim = make_cluster.sim(MODEL, "--zero-latency", "--fault-stall-rate", "1")
    make_cluster.agent(router, sim)
    wait_registered(router, MODEL)
    with httpx.stream(
        "POST", router.url + "/v1/chat/completions", json=_chat(20), timeout=30
    ) as reply:
        assert reply.status_code == 200
        text = reply.read().decode()
    assert "--stream-idle-timeout" in text and '"request_timeout"' in text
    assert "[DONE]" not in text
    # The router's slot and the engine's sequence are both given back.
    wait_until(lambda: _freed(router.metrics(), sim.metrics()))


def test_an_anthropic_stream_stalled_ends_with_an_error_event(make_cluster: Cluster) -> None:
    router = make_cluster.router("--stream-idle-timeout", "1s")
    sim = make_cluster.sim(MODEL, "--zero-latency", "--fault-stall-rate", "1")
    make_cluster.agent(router, sim)
    wait_registered(router, MODEL)
    body = {
        "model": MODEL,
        "max_tokens": 20,
        "stream": True,
        "messages": [{"role": "user", "content": "hi"}],
    }
    with httpx.stream("POST", router.url + "/v1/messages", json=body, timeout=30) as reply:
        text = reply.read().decode()
    assert "event: error" in text and "--stream-idle-timeout" in text
    assert "message_stop" not in text
    wait_until(lambda: _freed(router.metrics(), sim.metrics()))
