"""The predicted-latency strategy through real processes: a router, agents and simulators
of unlike speeds on loopback, driven with the openai SDK. What is asserted is where the
router sent each request (the simulators' counts), never how long it took."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx2 as httpx
import openai

from hivenet_router.routing.ttft import MIN_SAMPLES
from tests.procs import ADMIN_KEY, Cluster, Router, Sim, metric, wait_registered, wait_until

MODEL = "m"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
# Prefill is twenty-five times slower on the slow engine: 2,000 uncached tokens take a
# second there and 40 ms on the fast one.
SLOW = ("--ttft-base", "10ms", "--prefill-per-token", "500us", "--itl", "1ms")
FAST = ("--ttft-base", "10ms", "--prefill-per-token", "20us", "--itl", "1ms")
DOCUMENT = "Chapter one of a long report on tides, currents and the moon. " * 125  # 2,000 tokens


def served(sim: Sim) -> float:
    value = metric(sim.metrics(), "hivenet_sim_requests_total")
    assert value is not None
    return value


def table(router: Router) -> dict[str, dict[str, Any]]:
    reply = httpx.get(router.url + "/admin/routing-table", headers=ADMIN, timeout=5)
    reply.raise_for_status()
    return {a["metadata"]["machine"]: a for a in reply.json()["agents"]}


def samples(router: Router, machine: str) -> int:
    learnt = table(router).get(machine, {}).get("predicted_latency")
    return int(learnt["samples"]) if learnt else 0


def stream(client: openai.OpenAI, messages: list[Any]) -> str:
    chunks = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, stream=True
    )
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def where(sims: dict[str, Sim], send: Any) -> list[str]:
    """The simulators a call of `send` reached."""
    before = {name: served(sim) for name, sim in sims.items()}
    send()
    return [name for name, sim in sims.items() if served(sim) > before[name]]


def test_cold_long_prompts_go_to_the_fast_engine_and_hot_prefixes_stay_cached(
    make_cluster: Cluster, tmp_path: Path
) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text("routing_policy: {strategy: predicted-latency}\n")
    router = make_cluster.router("--policy-file", str(policy))
    slow = make_cluster.sim(MODEL, *SLOW, name="slow")
    make_cluster.agent(router, slow, "--machine", "slow", name="agent-slow")
    wait_registered(router, MODEL, replicas=1)
    conversation: list[Any] = [
        {"role": "system", "content": DOCUMENT},
        {"role": "user", "content": "What moves the tides?"},
    ]
    with router.openai() as client:
        # The conversation's first turn can only go to the slow engine, which caches it.
        conversation.append({"role": "assistant", "content": stream(client, conversation)})
        fast = make_cluster.sim(MODEL, *FAST, name="fast")
        make_cluster.agent(router, fast, "--machine", "fast", name="agent-fast")
        wait_registered(router, MODEL, replicas=2)
        sims = {"slow": slow, "fast": fast}
        # Distinct prompts of many lengths, until both engines are measured: an agent not
        # measured yet is predicted as the fastest measured one, so it gets its turn.
        for n in range(40):
            if min(samples(router, "slow"), samples(router, "fast")) >= MIN_SAMPLES:
                break
            text = f"Warm-up {n}: " + "a few words on waves " * (10 + 40 * (n % 5))
            stream(client, [{"role": "user", "content": text}])
        wait_until(lambda: samples(router, "fast") >= MIN_SAMPLES)
        wait_until(lambda: samples(router, "slow") >= MIN_SAMPLES)
        learnt = {m: table(router)[m]["predicted_latency"] for m in sims}
        assert learnt["slow"]["prefill_us_per_token"] > 4 * learnt["fast"]["prefill_us_per_token"]

        # A long prompt nobody holds: prefilled in full, so on the fast engine.
        cold = [{"role": "user", "content": "Another report entirely. " + DOCUMENT[:6000]}]
        assert where(sims, lambda: stream(client, cold)) == ["fast"]

        # The conversation's next turn: its 2,000-token prefix is cached on the slow
        # engine, where only the new question needs prefilling.
        conversation.append({"role": "user", "content": "And what moves the currents?"})
        assert where(sims, lambda: stream(client, conversation)) == ["slow"]

    hits = metric(slow.metrics(), "vllm:prefix_cache_hits_total")
    assert hits is not None and hits >= 1500
    text = router.metrics()
    assert (metric(text, "hivenet_ttft_predictions_total") or 0) >= 2 * MIN_SAMPLES
    assert metric(text, "hivenet_ttft_prediction_error_ratio", quantile="0.5") is not None
