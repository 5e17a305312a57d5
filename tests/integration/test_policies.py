"""Routing policies through real processes: static matches, fallback steps, SIGHUP reload."""

from __future__ import annotations

import signal
from pathlib import Path

import httpx2 as httpx

from tests.procs import Cluster, Router, Sim, metric, wait_registered, wait_until

MODEL = "m"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}

EU_FIRST = """\
routing_policy:
  match: {region: eu}
  strategy: least-loaded
  max_tries: 1
fallback_chain:
  - name: anywhere
    strategy: least-loaded
"""
US_ONLY = """\
routing_policy:
  match: {region: us}
  strategy: least-loaded
"""


def served(sim: Sim) -> float:
    return metric(sim.metrics(), "vllm:request_success_total")


def send(router: Router, count: int) -> list[int]:
    with httpx.Client(base_url=router.url, timeout=10) as client:
        return [client.post("/v1/chat/completions", json=CHAT).status_code for _ in range(count)]


def test_match_fallback_and_reload(make_cluster: Cluster, tmp_path: Path) -> None:
    policies = tmp_path / "policies"
    policies.mkdir()
    default = policies / "_default.yaml"
    default.write_text(EU_FIRST)
    router = make_cluster.router("--policy-model-dir", str(policies))
    eu = make_cluster.sim(MODEL, "--zero-latency", name="sim-eu")
    us = make_cluster.sim(MODEL, "--zero-latency", name="sim-us")
    make_cluster.agent(router, eu, "--region", "eu", name="agent-eu")
    make_cluster.agent(router, us, "--region", "us", name="agent-us")
    wait_registered(router, MODEL, replicas=2)

    # The primary step sends everything to the EU agent, load notwithstanding.
    assert send(router, 4) == [200] * 4
    assert (served(eu), served(us)) == (4.0, 0.0)

    # When the EU engine fails, its step is exhausted after one try and the fallback step
    # carries the request.
    eu.set_faults(error_rate=1.0)
    assert send(router, 2) == [200, 200]
    assert served(us) == 2.0
    text = router.metrics()
    assert metric(text, "hivenet_policy_fallback_routed_total", step="anywhere") == 2.0
    eu.set_faults(error_rate=0.0)

    # SIGHUP swaps the policy; an invalid edit afterwards keeps the working one.
    default.write_text(US_ONLY)
    router.proc.popen.send_signal(signal.SIGHUP)  # type: ignore[union-attr]
    wait_until(
        lambda: metric(router.metrics(), "hivenet_policy_reload_total", result="success") == 1.0
    )
    before = served(eu)
    assert send(router, 3) == [200] * 3
    assert served(eu) == before and served(us) == 5.0
    default.write_text("routing_policy: {strategy: fastest}\n")
    router.proc.popen.send_signal(signal.SIGHUP)  # type: ignore[union-attr]
    wait_until(lambda: "keeping the previous global policy" in router.proc.log())
    assert send(router, 1) == [200]
    assert served(us) == 6.0


def test_a_policy_that_matches_nothing(make_cluster: Cluster, tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text("routing_policy: {match: {engine: sglang}, strategy: least-loaded}\n")
    router = make_cluster.router("--policy-file", str(policy))
    sim = make_cluster.sim(MODEL, "--zero-latency")
    make_cluster.agent(router, sim)
    wait_registered(router, MODEL)
    reply = httpx.post(router.url + "/v1/chat/completions", json=CHAT, timeout=10)
    assert reply.status_code == 503
    error = reply.json()["error"]
    assert error["code"] == "no_agents_available" and "policy global" in error["message"]


def test_an_invalid_policy_stops_the_router(make_cluster: Cluster, tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        "routing_policy:\n  strategy: least-loaded\n  exclude_if:\n    sucess_rate: {lt: 0.9}\n"
    )
    log = make_cluster.refused_router("--policy-file", str(policy))
    assert "policy.yaml:4: routing_policy.exclude_if.sucess_rate: unknown signal" in log


def test_a_kv_cache_gate_steers_away_from_a_full_engine(
    make_cluster: Cluster, tmp_path: Path
) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        "routing_policy:\n  strategy: least-loaded\n"
        "  exclude_if:\n    kv_cache_utilization: {gt: 0.5}\n"
    )
    router = make_cluster.router("--policy-file", str(policy))
    full = make_cluster.sim(
        MODEL, "--kv-cache-tokens", "256", "--itl", "100ms", "--ttft-base", "0", name="sim-full"
    )
    free = make_cluster.sim(MODEL, "--zero-latency", name="sim-free")
    make_cluster.agent(router, full, name="agent-full")
    make_cluster.agent(router, free, name="agent-free")
    wait_registered(router, MODEL, replicas=2)
    # Fill the first engine's KV cache with a long request sent to it directly.
    body = {**CHAT, "max_tokens": 200, "stream": True}
    with httpx.stream("POST", full.url + "/v1/chat/completions", json=body, timeout=30):
        wait_until(
            lambda: metric(router.metrics(), "hivenet_agent_engine_kv_cache_utilization") > 0.5
        )
        assert send(router, 4) == [200] * 4
        assert served(free) == 4.0
        assert metric(full.metrics(), "hivenet_sim_requests_total") == 1.0


async def test_occupancy_admission(make_cluster: Cluster, tmp_path: Path) -> None:
    import asyncio

    policy = tmp_path / "policy.yaml"
    policy.write_text("max_inflight: 1\nrouting_policy: {strategy: least-loaded}\n")
    router = make_cluster.router(
        "--policy-file", str(policy), env={"HIVENET_ROUTER_ADMIT_PARK_TIMEOUT": "100ms"}
    )
    sim = make_cluster.sim(MODEL, "--ttft-base", "600ms")
    make_cluster.agent(router, sim)
    wait_registered(router, MODEL)
    async with httpx.AsyncClient(base_url=router.url, timeout=10) as client:
        replies = await asyncio.gather(
            *(client.post("/v1/chat/completions", json=CHAT) for _ in range(2))
        )
        refused = next(r for r in replies if r.status_code == 429)
        assert sorted(r.status_code for r in replies) == [200, 429]
        assert refused.json()["error"]["code"] == "concurrency_limit_exceeded"
        assert refused.headers["Retry-After"] == "1"
        # The reservation was released with the first answer.
        assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
    text = router.metrics()
    assert metric(text, "hivenet_admission_rejections_total", reason="b2") == 1.0
    assert metric(text, "hivenet_admission_inflight_requests", model=MODEL) == 0.0
    assert metric(text, "hivenet_admission_max_inflight", model=MODEL) == 1.0
