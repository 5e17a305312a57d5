"""The stream validator end to end: a local simulator that falls into " over and over" in
some of its answers, a cloud simulator as the policy's provider, the official SDKs.

What must hold: no client ever receives a degenerate answer; the provider (or the other
agent) is asked exactly for the answers the validator rejected; and the rejected local
attempts leave no trace in usage: each audit record carries the tokens of the answer the
client received.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

from hivenet_router.gateway.degenerate import Detector
from hivenet_router.gateway.settings import ValidatorSettings
from tests.procs import Cluster, Router, Sim, metric, wait_registered, wait_until

MODEL = "m"
LOCAL_TOKENS = 40  # what a local answer has (max_tokens)
CLOUD_TOKENS = 30  # what a cloud answer has (--answer-cap): the two tell apart in records
POLICY = """\
models: [m]
routing_policy:
  strategy: least-loaded
  max_tries: 1
# Each rejected answer counts as a failure of its agent: with breakers on, a run of loops
# would open the agent's breaker and send requests to the provider unjudged, which this
# test does not count on.
circuit_breaker:
  enabled: false
stream_validator: {}
"""
PROVIDER = """\
fallback_provider:
  engine: {engine}
  model: cloud-model
"""


def router_with(cluster: Cluster, tmp_path: Path, engine: str | None) -> tuple[Router, Sim | None]:
    """A router whose policy for model m turns the validator on, with `engine` as its
    provider (a simulator) or none."""
    policies = tmp_path / "policies"
    policies.mkdir()
    text = POLICY + (PROVIDER.format(engine=engine) if engine else "")
    (policies / "m.yaml").write_text(text)
    if engine is None:
        return cluster.router("--policy-model-dir", str(policies)), None
    cloud = cluster.sim(
        "cloud-model", "--zero-latency", "--answer-cap", str(CLOUD_TOKENS), name="cloud"
    )
    prefix = f"HIVENET_ROUTER_{engine.upper()}"
    env = {f"{prefix}_API_KEY": "test-key", f"{prefix}_BASE_URL": cloud.url}
    return cluster.router("--policy-model-dir", str(policies), env=env), cloud


def local_sim(cluster: Cluster, repeat_rate: float, name: str = "sim") -> Sim:
    # A token every 2 ms: the stream arrives in many chunks, so the held window is a real
    # window and not the whole answer.
    return cluster.sim(
        MODEL,
        "--itl",
        "2ms",
        "--ttft-base",
        "0s",
        "--fault-repeat-rate",
        str(repeat_rate),
        name=name,
    )


def requests(sim: Sim) -> float:
    count = metric(sim.metrics(), "hivenet_sim_requests_total")
    assert count is not None
    return count


def audit(router: Router, count: int) -> list[dict[str, Any]]:
    """The audit records of the model's requests, once `count` of them are written."""
    assert router.audit is not None
    path = router.audit
    found: list[dict[str, Any]] = []

    def written() -> bool:
        found.clear()
        if path.exists():
            for line in path.read_bytes().splitlines():
                record = orjson.loads(line)
                if record["model"] == MODEL:
                    found.append(record)
        return len(found) >= count

    wait_until(written, timeout=5)
    return found


def sound(text: str) -> bool:
    detector = Detector(ValidatorSettings())
    detector.feed(text)
    return " over" not in text and detector.finish() is None and len(text.split()) > 10


def validator_counts(router: Router) -> tuple[float | None, ...]:
    page = router.metrics()
    return tuple(
        metric(page, "hivenet_validator_streams_total", result=result)
        for result in ("clean", "degenerate", "late_degenerate")
    )


def test_openai_streams_loops_go_to_the_provider(make_cluster: Cluster, tmp_path: Path) -> None:
    router, cloud = router_with(make_cluster, tmp_path, "openai")
    assert cloud is not None
    local = local_sim(make_cluster, 0.3)
    make_cluster.agent(router, local)
    wait_registered(router, MODEL)
    total = 40
    with router.openai() as client:
        for index in range(total):
            chunks = list(
                client.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": f"question {index}"}],
                    max_tokens=LOCAL_TOKENS,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert sound(text), (index, text)
    records = audit(router, total)
    replaced = [r for r in records if r.get("replaced") == "degenerate"]
    assert 0 < len(replaced) < total  # seeded: some answers looped, not all
    assert requests(cloud) == len(replaced)  # the provider, exactly for those
    assert requests(local) == total  # and every request went local first
    for record in records:
        # 499: the SDK hangs up on [DONE] before the router reads the stream's end; this
        # happens without the validator too, and the answer was whole.
        assert record["status_code"] in (200, 499)
        if record in replaced:  # billed as the cloud's answer, not the rejected local one
            assert record["agent_id"] == "provider:openai"
            assert record["output_tokens"] == CLOUD_TOKENS
        else:
            assert record["output_tokens"] == LOCAL_TOKENS and "replaced" not in record
    assert validator_counts(router) == (total - len(replaced), len(replaced), 0)
    assert metric(router.metrics(), "hivenet_router_active_forwards") == 0.0


def test_without_a_provider_the_other_agent_serves(make_cluster: Cluster, tmp_path: Path) -> None:
    router, _ = router_with(make_cluster, tmp_path, None)
    looping, healthy = (
        local_sim(make_cluster, 1.0, "looping"),
        local_sim(make_cluster, 0.0, "healthy"),
    )
    # The looping agent joins first, so it is chosen first (of agents that have not
    # served yet, the first to join goes first).
    make_cluster.agent(router, looping, name="agent-looping")
    wait_registered(router, MODEL)
    make_cluster.agent(router, healthy, name="agent-healthy")
    wait_registered(router, MODEL, replicas=2)
    total = 10
    with router.openai() as client:
        for index in range(total):
            chunks = client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": f"again {index}"}],
                max_tokens=LOCAL_TOKENS,
                stream=True,
            )
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert sound(text), (index, text)
    records = audit(router, total)
    replaced = sum(1 for r in records if r.get("replaced") == "degenerate")
    assert replaced == requests(looping) > 0
    assert requests(healthy) == total
    assert len({r["agent_id"] for r in records}) == 1  # the healthy agent answered them all


def test_anthropic_messages_loops_go_to_the_provider(make_cluster: Cluster, tmp_path: Path) -> None:
    router, cloud = router_with(make_cluster, tmp_path, "anthropic")
    assert cloud is not None
    local = local_sim(make_cluster, 0.5)
    make_cluster.agent(router, local)
    wait_registered(router, MODEL)
    total = 10
    with router.anthropic() as client:
        for index in range(total):
            with client.messages.stream(
                model=MODEL,
                max_tokens=LOCAL_TOKENS,
                messages=[{"role": "user", "content": f"message {index}"}],
            ) as stream:
                text = "".join(stream.text_stream)
                usage = stream.get_final_message().usage
            assert sound(text), (index, text)
            assert usage.output_tokens in (LOCAL_TOKENS, CLOUD_TOKENS)
    records = audit(router, total)
    replaced = [r for r in records if r.get("replaced") == "degenerate"]
    assert 0 < len(replaced) < total
    assert requests(cloud) == len(replaced)
    assert all(r["output_tokens"] == CLOUD_TOKENS for r in replaced)
