"""Provider fallback against a local server that speaks the providers' wire protocols.

The engine simulator serves both /v1/chat/completions and /v1/messages, so it stands in for
OpenAI and Anthropic: only the model name tells the answers apart.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import httpx2 as httpx

from tests.procs import Cluster, Router, metric, wait_registered, wait_until

MODEL = "m"
POLICY = """\
models: [m]
routing_policy:
  strategy: least-loaded
  max_tries: 1
fallback_provider:
  engine: {engine}
  model: cloud-model
"""


def with_provider(
    cluster: Cluster, tmp_path: Path, engine: str, key: str, *cloud_flags: str
) -> Router:
    """A router whose policy for model m falls back to `engine`, served by a simulator."""
    cloud = cluster.sim("cloud-model", "--zero-latency", *cloud_flags, name="cloud")
    policies = tmp_path / "policies"
    policies.mkdir()
    (policies / "m.yaml").write_text(POLICY.format(engine=engine))
    prefix = f"HIVENET_ROUTER_{engine.upper()}"
    return cluster.router(
        "--policy-model-dir",
        str(policies),
        env={f"{prefix}_API_KEY": key, f"{prefix}_BASE_URL": cloud.url},
    )


def test_openai_fallback_when_every_local_step_fails(make_cluster: Cluster, tmp_path: Path) -> None:
    router = with_provider(make_cluster, tmp_path, "openai", "sk-test-not-real")
    local = make_cluster.sim(MODEL, "--zero-latency", "--fault-error-rate", "1")
    make_cluster.agent(router, local)
    wait_registered(router, MODEL)
    with router.openai() as client:
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert reply.model == "cloud-model"
        rid = str(uuid.uuid4())
        chunks = list(
            client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=4,
                stream=True,
                extra_headers={"X-Request-ID": rid},
            )
        )
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        # The router asked the provider for usage: metered exactly, kept from this client.
        assert all(c.usage is None and c.choices for c in chunks)
    wait_until(lambda: any(r["request_id"] == rid for r in router.audit_records()))
    (record,) = [r for r in router.audit_records() if r["request_id"] == rid]
    assert (record["status_code"], record["output_tokens"]) == (200, 4)
    text = router.metrics()
    assert metric(text, "hivenet_policy_provider_fallback_total", provider="openai") == 2.0
    assert (
        metric(
            text, "http_client_request_duration_seconds_count", provider="openai", status_code="200"
        )
        == 2.0
    )
    assert metric(text, "hivenet_router_active_forwards") == 0.0
    # The provider credential never reaches the logs.
    assert "sk-test-not-real" not in router.proc.log()


def test_anthropic_fallback_for_a_model_without_agents(
    make_cluster: Cluster, tmp_path: Path
) -> None:
    router = with_provider(make_cluster, tmp_path, "anthropic", "ak-test")
    with router.anthropic() as client:
        reply = client.messages.create(
            model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "hi"}]
        )
        assert reply.model == "cloud-model" and reply.usage.output_tokens == 5
    # OpenAI routes are not sent to an Anthropic provider: no schema translation.
    chat = httpx.post(
        router.url + "/v1/chat/completions",
        timeout=10,
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
    )
    assert chat.status_code == 404 and chat.json()["error"]["code"] == "model_not_found"


def test_provider_failure_is_a_backend_error(make_cluster: Cluster, tmp_path: Path) -> None:
    router = with_provider(make_cluster, tmp_path, "openai", "sk", "--fault-error-rate", "1")
    reply = httpx.post(
        router.url + "/v1/chat/completions",
        timeout=10,
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
    )
    assert reply.status_code == 502
    error = reply.json()["error"]
    assert error["code"] == "backend_error" and error["source"] == "backend"
    assert error["message"] == "provider openai refused the request (HTTP 500)"


def test_a_provider_without_its_credential_stops_the_router(
    make_cluster: Cluster, tmp_path: Path
) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY.format(engine="openai"))
    log = make_cluster.refused_router(
        "--policy-file", str(policy), env={"HIVENET_ROUTER_OPENAI_API_KEY": ""}
    )
    assert "HIVENET_ROUTER_OPENAI_API_KEY" in log
