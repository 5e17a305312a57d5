"""The validator's syntax judging end to end: a local simulator that breaks the JSON of some
of its structured answers and tool calls (`--fault-syntax-rate`), a cloud simulator as the
policy's provider, the official SDKs.

What must hold: no client ever receives broken JSON; the provider is asked exactly for the
answers the validator rejected (`replaced: syntax` on their audit records); and each audit
record bills the answer the client received, not the rejected local attempt. Past the held
window, a late break ends the stream with `malformed_output` and no complete broken
document reaches the client.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
import pytest

from hivenet_router.gateway.schema_subset import violation
from tests.integration.test_stream_validator import MODEL, audit, requests
from tests.procs import Cluster, Router, Sim, metric, wait_registered

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA}}
TOOLS = [{"type": "function", "function": {"name": "trip", "parameters": SCHEMA}}]
POLICY = """\
models: [m]
routing_policy:
  strategy: least-loaded
  max_tries: 1
circuit_breaker:
  enabled: false
stream_validator: {validator}
fallback_provider:
  engine: {engine}
  model: cloud-model
"""


def setup(
    cluster: Cluster, tmp_path: Path, validator: str, rate: float, engine: str = "openai"
) -> tuple[Router, Sim, Sim]:
    policies = tmp_path / "policies"
    policies.mkdir()
    (policies / "m.yaml").write_text(POLICY.format(validator=validator, engine=engine))
    cloud = cluster.sim("cloud-model", "--zero-latency", name="cloud")
    prefix = f"HIVENET_ROUTER_{engine.upper()}"
    env = {f"{prefix}_API_KEY": "k", f"{prefix}_BASE_URL": cloud.url}
    router = cluster.router("--policy-model-dir", str(policies), env=env)
    local = cluster.sim(
        MODEL, "--itl", "2ms", "--ttft-base", "0s", "--fault-syntax-rate", str(rate), name="sim"
    )
    cluster.agent(router, local)
    wait_registered(router, MODEL)
    return router, local, cloud


def counts(router: Router, *results: str) -> tuple[float | None, ...]:
    page = router.metrics()
    return tuple(metric(page, "hivenet_validator_streams_total", result=r) for r in results)


def check_billing(
    records: list[dict[str, Any]], used: list[int], cloud: Sim, engine: str = "openai"
) -> None:
    replaced = [r for r in records if r.get("replaced") == "syntax"]
    assert 0 < len(replaced) < len(records)  # seeded: some answers broke, not all
    assert requests(cloud) == len(replaced)  # the provider, exactly for those
    for record in replaced:
        assert record["agent_id"] == f"provider:{engine}"
        assert record["replaced_reason"].startswith(("json:", "tool_args:")), record
    assert sorted(r["output_tokens"] for r in records) == sorted(used)
    assert all(r.get("replaced") in (None, "syntax") for r in records)


def test_structured_streams_never_reach_the_client_broken(
    make_cluster: Cluster, tmp_path: Path
) -> None:
    router, local, cloud = setup(make_cluster, tmp_path, "{}", 0.3)
    total, used = 30, []
    with router.openai() as client:
        for index in range(total):
            chunks = list(
                client.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": f"plan {index}"}],
                    response_format=FORMAT,  # type: ignore[arg-type]
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert violation(json.loads(text), SCHEMA) is None, (index, text)
            usage = chunks[-1].usage
            assert usage is not None
            used.append(usage.completion_tokens)
    records = audit(router, total)
    check_billing(records, used, cloud)
    assert requests(local) == total
    replaced = sum(1 for r in records if r.get("replaced") == "syntax")
    assert counts(router, "clean", "syntax") == (total - replaced, replaced)
    page = router.metrics()
    assert metric(page, "hivenet_validator_syntax_failures_total", check="json") == replaced
    assert metric(page, "hivenet_router_active_forwards") == 0.0


def test_tool_calls_whole_and_streamed(make_cluster: Cluster, tmp_path: Path) -> None:
    router, _local, cloud = setup(make_cluster, tmp_path, "{}", 0.4)
    total, used = 24, []
    with router.openai() as client:
        for index in range(total):
            stream = index % 2 == 0
            kwargs: dict[str, Any] = {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"call {index}"}],
                "tools": TOOLS,
                "tool_choice": "required",
            }
            if stream:
                chunks = list(
                    client.chat.completions.create(
                        **kwargs, stream=True, stream_options={"include_usage": True}
                    )
                )
                arguments = "".join(
                    (c.choices[0].delta.tool_calls or [])[0].function.arguments or ""  # type: ignore[union-attr]
                    for c in chunks
                    if c.choices and c.choices[0].delta.tool_calls
                )
                usage = chunks[-1].usage
            else:
                reply = client.chat.completions.create(**kwargs)
                calls = reply.choices[0].message.tool_calls
                assert calls
                arguments = calls[0].function.arguments  # type: ignore[union-attr]
                usage = reply.usage
            assert violation(json.loads(arguments), SCHEMA) is None, (index, arguments)
            assert usage is not None
            used.append(usage.completion_tokens)
    check_billing(audit(router, total), used, cloud)


def test_anthropic_tool_use_streams(make_cluster: Cluster, tmp_path: Path) -> None:
    router, _local, cloud = setup(make_cluster, tmp_path, "{}", 0.4, engine="anthropic")
    tool = {"name": "trip", "input_schema": SCHEMA}
    total, used = 16, []
    with router.anthropic() as client:
        for index in range(total):
            with client.messages.stream(
                model=MODEL,
                max_tokens=64,
                messages=[{"role": "user", "content": f"go {index}"}],
                tools=[tool],  # type: ignore[list-item]
                tool_choice={"type": "any"},
            ) as stream:
                message = stream.get_final_message()  # the SDK parses the input's JSON
            calls = [block for block in message.content if block.type == "tool_use"]
            assert calls and violation(calls[0].input, SCHEMA) is None, (index, message)
            used.append(message.usage.output_tokens)
    check_billing(audit(router, total), used, cloud, engine="anthropic")


def test_a_late_break_ends_the_stream_with_malformed_output(
    make_cluster: Cluster, tmp_path: Path
) -> None:
    router, _local, cloud = setup(make_cluster, tmp_path, "{hold_chunks: 1}", 1.0)
    with router.openai() as client:
        for index in range(3):
            received = ""
            with pytest.raises(openai.APIError) as caught:
                for chunk in client.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": f"late {index}"}],
                    response_format=FORMAT,  # type: ignore[arg-type]
                    stream=True,
                ):
                    if chunk.choices:
                        received += chunk.choices[0].delta.content or ""
            assert "malformed" in str(caught.value.message), caught.value
            with pytest.raises(json.JSONDecodeError):
                json.loads(received)  # a part, never a whole broken document
            assert "\\q" not in received  # the chunk that broke it was withheld
    records = audit(router, 3)
    assert all(r["error_code"] == "malformed_output" for r in records), records
    assert requests(cloud) == 0  # too late to replace
    assert counts(router, "late_syntax") == (3,)


def test_without_a_provider_the_other_agent_serves(make_cluster: Cluster, tmp_path: Path) -> None:
    policies = tmp_path / "policies"
    policies.mkdir()
    text = POLICY.format(validator="{}", engine="openai").split("fallback_provider")[0]
    (policies / "m.yaml").write_text(text)
    router = make_cluster.router("--policy-model-dir", str(policies))
    broken = make_cluster.sim(MODEL, "--zero-latency", "--fault-syntax-rate", "1", name="broken")
    sound = make_cluster.sim(MODEL, "--zero-latency", name="sound")
    # The broken agent joins first, so it is chosen first (of agents that have not served
    # yet, the first to join goes first); after its failure the request avoids it.
    make_cluster.agent(router, broken, name="agent-broken")
    wait_registered(router, MODEL)
    make_cluster.agent(router, sound, name="agent-sound")
    wait_registered(router, MODEL, replicas=2)
    total = 8
    with router.openai() as client:
        for index in range(total):
            reply = client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": f"again {index}"}],
                response_format=FORMAT,  # type: ignore[arg-type]
            )
            content = reply.choices[0].message.content or ""
            assert violation(json.loads(content), SCHEMA) is None, (index, content)
    records = audit(router, total)
    replaced = sum(1 for r in records if r.get("replaced") == "syntax")
    assert replaced == requests(broken) > 0
    assert requests(sound) == total
