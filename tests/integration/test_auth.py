"""Client and administrator authentication, and the admin API, through real processes."""

from __future__ import annotations

import hashlib
import signal
from pathlib import Path

import httpx2 as httpx
import openai
import pytest

from tests.procs import ADMIN_KEY, Cluster, Router, metric, wait_until

MODEL, OTHER = "m", "other"
KEY = "sk-hivenet-client-one"
LIMITED = "sk-hivenet-client-two"


def entry(raw: str, owner: str, models: list[str] | None = None) -> str:
    text = (
        f'    - key_hash: "{hashlib.sha256(raw.encode()).hexdigest()}"\n'
        f"      metadata: {{name: {owner}, owner: {owner}}}\n"
    )
    if models:
        text += f"      models: [{', '.join(models)}]\n"
    return text


def auth_file(tmp: Path, *entries: str) -> Path:
    path = tmp / "auth.yaml"
    path.write_text(
        "api:\n  mode: api-key\n  keys:\n" + "".join(entries) + "admin:\n  mode: api-key\n"
    )
    return path


@pytest.fixture
def secured(make_cluster: Cluster, tmp_path: Path) -> tuple[Cluster, Router, Path]:
    path = auth_file(tmp_path, entry(KEY, "acme"), entry(LIMITED, "beta", [MODEL]))
    router = make_cluster.router("--auth-config-file", str(path))
    for model in (MODEL, OTHER):
        sim = make_cluster.sim(model, "--zero-latency", name=f"sim-{model}")
        make_cluster.agent(router, sim, name=f"agent-{model}")
    return make_cluster, router, path


def _models(router: Router, key: str) -> list[str]:
    reply = httpx.get(
        router.url + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=5
    )
    return [m["id"] for m in reply.json()["data"]]


def test_client_keys(secured: tuple[Cluster, Router, Path]) -> None:
    _, router, _ = secured
    wait_until(lambda: sorted(_models(router, KEY)) == [MODEL, OTHER])
    # Missing, wrong and admin keys are all the same 401 on /v1/*.
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": f"Bearer {ADMIN_KEY}"}):
        reply = httpx.get(router.url + "/v1/models", headers=headers, timeout=5)
        assert reply.status_code == 401
        assert reply.json()["error"]["code"] == "unauthorized"
        assert reply.headers["WWW-Authenticate"] == 'Bearer realm="hivenet-router"'
    assert httpx.get(router.url + "/health", timeout=5).status_code == 200  # public
    with router.openai(KEY) as client:
        assert (
            client.chat.completions.create(
                model=OTHER, messages=[{"role": "user", "content": "x"}], max_tokens=2
            )
            .choices[0]
            .message.content
        )
    with router.anthropic(KEY) as claude:
        # The Anthropic SDK sends x-api-key, which the router accepts too.
        assert claude.messages.create(
            model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "x"}]
        ).content


def test_model_allowlists(secured: tuple[Cluster, Router, Path]) -> None:
    _, router, _ = secured
    wait_registered_with(router, KEY, 2)
    assert _models(router, LIMITED) == [MODEL]
    headers = {"Authorization": f"Bearer {LIMITED}"}
    hidden = httpx.get(router.url + f"/v1/models/{OTHER}", headers=headers, timeout=5)
    assert hidden.status_code == 404 and hidden.json()["error"]["code"] == "model_not_found"
    reply = httpx.post(
        router.url + "/v1/chat/completions",
        headers=headers,
        timeout=5,
        json={"model": OTHER, "messages": [{"role": "user", "content": "x"}]},
    )
    assert reply.status_code == 403
    assert reply.json()["error"]["code"] == "model_forbidden"


def wait_registered_with(router: Router, key: str, count: int) -> None:
    wait_until(lambda: len(_models(router, key)) == count)


def test_admin_api_and_its_separate_keys(secured: tuple[Cluster, Router, Path]) -> None:
    _, router, _ = secured
    wait_registered_with(router, KEY, 2)
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    for headers in ({}, {"Authorization": f"Bearer {KEY}"}):
        assert (
            httpx.get(router.url + "/admin/health", headers=headers, timeout=5).status_code == 401
        )
    health = httpx.get(router.url + "/admin/health", headers=admin, timeout=5).json()
    assert health["total_agents"] == 2 and health["models"][MODEL]["eligible"] == 1
    table = httpx.get(router.url + "/admin/routing-table", headers=admin, timeout=5).json()
    peer = next(a["peer_id"] for a in table["agents"] if a["metadata"]["model"] == MODEL)
    # Drain: no new requests go to the agent; undrain brings it back.
    drained = httpx.post(router.url + f"/admin/agents/{peer}/drain", headers=admin, timeout=5)
    assert drained.json()["draining"] is True
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
    client = {"Authorization": f"Bearer {KEY}"}
    assert (
        httpx.post(
            router.url + "/v1/chat/completions", json=body, headers=client, timeout=5
        ).status_code
        == 503
    )
    httpx.post(router.url + f"/admin/agents/{peer}/undrain", headers=admin, timeout=5)
    assert (
        httpx.post(
            router.url + "/v1/chat/completions", json=body, headers=client, timeout=5
        ).status_code
        == 200
    )
    policy = httpx.get(router.url + "/admin/policy", headers=admin, timeout=5).json()
    assert policy["routing_policy"]["strategy"] == "least-loaded"
    removed = httpx.delete(router.url + f"/admin/agents/{peer}", headers=admin, timeout=5)
    assert removed.json()["removed"] is True
    assert (
        httpx.get(router.url + f"/admin/agents/{peer}", headers=admin, timeout=5).status_code == 404
    )


def test_sighup_reloads_keys_and_refuses_a_mode_switch(
    secured: tuple[Cluster, Router, Path],
) -> None:
    _, router, path = secured
    wait_registered_with(router, KEY, 2)
    fresh = "sk-hivenet-added-later"
    auth_file(path.parent, entry(fresh, "gamma"))
    router.proc.popen.send_signal(signal.SIGHUP)  # type: ignore[union-attr]
    wait_until(
        lambda: (
            httpx.get(
                router.url + "/v1/models", timeout=5, headers={"Authorization": f"Bearer {fresh}"}
            ).status_code
            == 200
        )
    )
    assert (
        httpx.get(
            router.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=5
        ).status_code
        == 401
    )  # removed from the file
    path.write_text("api:\n  mode: none\nadmin:\n  mode: api-key\n")
    reply = httpx.post(
        router.url + "/admin/reload", timeout=5, headers={"Authorization": f"Bearer {ADMIN_KEY}"}
    )
    assert reply.status_code == 409 and reply.json() == {"policies": True, "auth": False}
    assert "needs a restart" in router.proc.log()
    assert httpx.get(router.url + "/v1/models", timeout=5).status_code == 401


def test_no_admin_credentials_no_start(make_cluster: Cluster) -> None:
    log = make_cluster.refused_router(env={"HIVENET_ROUTER_ADMIN_API_KEYS": ""})
    assert "HIVENET_ROUTER_ALLOW_INSECURE_ADMIN" in log


def test_quotas(make_cluster: Cluster, tmp_path: Path) -> None:
    rpm, budget, strict = "sk-hivenet-rpm", "sk-hivenet-budget", "sk-hivenet-strict"
    path = tmp_path / "auth.yaml"
    path.write_text(
        "api:\n  mode: api-key\n  keys:\n"
        + entry(rpm, "rpm-tenant")
        + "      quota: {requests_per_minute: 2}\n"
        + entry(budget, "budget-tenant")
        + "      quota: {tokens_per_day: 200}\n"
        + entry(strict, "strict-tenant")
        + "      quota:\n        per_model:\n          m: {requests_per_minute_per_replica: 100,"
        " tokens_per_day: 0}\n" + "admin:\n  mode: api-key\n"
    )
    router = make_cluster.router("--auth-config-file", str(path))
    for model in (MODEL, OTHER):
        sim = make_cluster.sim(model, "--zero-latency", name=f"sim-{model}")
        make_cluster.agent(router, sim, name=f"agent-{model}")
    wait_registered_with(router, budget, 2)

    def chat(key: str, model: str = MODEL, **extra: object) -> httpx.Response:
        return httpx.post(
            router.url + "/v1/chat/completions",
            timeout=10,
            headers={"Authorization": f"Bearer {key}"},
            json={
                "model": model,
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 5,
                **extra,
            },
        )

    first = chat(rpm)
    assert first.status_code == 200 and first.headers["X-RateLimit-Remaining-Requests"] == "1"
    assert chat(rpm).status_code == 200
    limited = chat(rpm)
    assert limited.status_code == 429
    assert limited.json()["error"]["code"] == "rate_limit_exceeded"
    assert limited.headers["X-RateLimit-Remaining-Requests"] == "0"
    assert limited.headers["Retry-After"] == "30"  # 2 a minute: one refills in 30 s
    text = router.metrics()
    assert metric(text, "hivenet_tenant_rate_limited_total", tenant_id="rpm-tenant") == 1.0
    assert metric(text, "hivenet_tenant_requests_success_total", tenant_id="rpm-tenant") == 2.0

    # The daily budget charges the worst case up front and refuses what cannot fit.
    assert chat(budget).status_code == 200
    over = chat(budget, max_tokens=500)
    assert over.status_code == 429 and over.json()["error"]["code"] == "token_limit_exceeded"
    assert int(over.headers["X-RateLimit-Remaining-Tokens"]) > 0

    quotas = httpx.get(
        router.url + "/admin/quotas", timeout=5, headers={"Authorization": f"Bearer {ADMIN_KEY}"}
    ).json()
    by_owner = {k["owner"]: k for k in quotas["keys"]}
    assert by_owner["rpm-tenant"]["quota"]["requests_per_minute"] == 2
    assert by_owner["budget-tenant"]["tokens_used_today"]["*"] > 0
    assert all("key_hash" not in k for k in quotas["keys"])
    # Per-model quotas list the only models the key may use.
    assert chat(strict).status_code == 200
    assert _models(router, strict) == [MODEL]
    unlisted = chat(strict, OTHER)
    assert unlisted.status_code == 429
    assert "no quota declared for model other" in unlisted.json()["error"]["message"]


def test_daily_totals_survive_a_restart_with_the_persistent_backend(
    make_cluster: Cluster, tmp_path: Path
) -> None:
    budget = "sk-hivenet-persisted"
    path = tmp_path / "auth.yaml"
    path.write_text(
        "api:\n  mode: api-key\n  keys:\n"
        + entry(budget, "acme")
        + "      quota: {tokens_per_day: 100000}\nadmin:\n  mode: api-key\n"
    )
    env = {"HIVENET_ROUTER_QUOTA_BACKEND": "badger"}
    router = make_cluster.router("--auth-config-file", str(path), env=env)
    sim = make_cluster.sim(MODEL, "--zero-latency")
    make_cluster.agent(router, sim)
    wait_registered_with(router, budget, 1)
    reply = httpx.post(
        router.url + "/v1/chat/completions",
        timeout=10,
        headers={"Authorization": f"Bearer {budget}"},
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 7},
    )
    assert reply.status_code == 200
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    used = httpx.get(router.url + "/admin/usage", headers=admin, timeout=5).json()
    assert used["budgets"][0]["tenant"] == "acme"
    spent = used["budgets"][0]["tokens_used"]
    assert spent == reply.json()["usage"]["total_tokens"]  # trued up to exact usage
    router.proc.stop()
    again = make_cluster.router("--auth-config-file", str(path), ports=router, env=env)
    after = httpx.get(again.url + "/admin/usage", headers=admin, timeout=5).json()
    assert after["budgets"] == used["budgets"]


def test_unknown_quota_backend_is_refused(make_cluster: Cluster) -> None:
    log = make_cluster.refused_router(env={"HIVENET_ROUTER_QUOTA_BACKEND": "redis"})
    assert "'redis' is not one of memory, badger" in log and "QUOTA_BACKEND" in log


def test_dynamic_keys(make_cluster: Cluster) -> None:
    router = make_cluster.router(env={"HIVENET_ROUTER_AUTH_MODE": "dynamic"})
    sim = make_cluster.sim(MODEL, "--zero-latency")
    make_cluster.agent(router, sim)
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    raw = "sk-hivenet-dynamic"
    assert (
        httpx.get(
            router.url + "/v1/models", timeout=5, headers={"Authorization": f"Bearer {raw}"}
        ).status_code
        == 401
    )
    put = httpx.put(
        router.url + "/admin/api-keys/acme-prod",
        headers=admin,
        timeout=5,
        json={
            "version": "rev_0001",
            "key_hash": hashlib.sha256(raw.encode()).hexdigest(),
            "owner": "acme",
            "name": "prod",
            "enabled": True,
            "quota": {"requests_per_minute": 1},
        },
    )
    assert put.json() == {"ok": True}
    # A body past --max-request-bytes (10 MiB) is refused with the envelope, not a 500.
    huge = httpx.post(
        router.url + "/admin/api-keys/replace",
        headers=admin,
        timeout=20,
        content=b'{"version": "rev_9", "keys": [' + b" " * (11 << 20) + b"]}",
    )
    assert huge.status_code == 413 and huge.json()["error"]["code"] == "request_too_large"
    wait_registered_with(router, raw, 1)
    # Discovery skips quota admission; the first inference request uses the one per minute.
    with router.openai(raw) as client:
        messages = [{"role": "user", "content": "x"}]
        assert client.chat.completions.create(model=MODEL, max_tokens=2, messages=messages)
        with pytest.raises(openai.RateLimitError):
            client.chat.completions.create(model=MODEL, max_tokens=2, messages=messages)
    version = httpx.get(router.url + "/admin/api-keys/version", headers=admin, timeout=5)
    assert version.json() == {"version": "rev_0001", "count": 1}
    stale = httpx.delete(
        router.url + "/admin/api-keys/acme-prod?version=rev_0000", headers=admin, timeout=5
    )
    assert stale.status_code == 409 and stale.json()["current_version"] == "rev_0001"
    # SIGHUP keeps the registry.
    router.proc.popen.send_signal(signal.SIGHUP)  # type: ignore[union-attr]
    wait_until(lambda: "auth reloaded (api.mode dynamic)" in router.proc.log())
    listed = httpx.get(router.url + "/admin/api-keys", headers=admin, timeout=5).json()
    assert [k["id"] for k in listed["keys"]] == ["acme-prod"]
    # One key, wrapped as the reference answers it (found by an operator of the Go router).
    one = httpx.get(router.url + "/admin/api-keys/acme-prod", headers=admin, timeout=5)
    assert one.json()["key"]["id"] == "acme-prod" and one.json()["key"]["key_hash"] == ""
    missing = httpx.get(router.url + "/admin/api-keys/nobody", headers=admin, timeout=5)
    assert missing.status_code == 404 and missing.json() == {"error": "key not found: nobody"}
    httpx.delete(
        router.url + "/admin/api-keys/acme-prod?version=rev_0002", headers=admin, timeout=5
    )
    assert (
        httpx.get(
            router.url + "/v1/models", timeout=5, headers={"Authorization": f"Bearer {raw}"}
        ).status_code
        == 401
    )


def test_registry_endpoints_need_dynamic_mode(
    secured: tuple[Cluster, Router, Path],
) -> None:
    _, router, _ = secured
    reply = httpx.get(
        router.url + "/admin/api-keys", timeout=5, headers={"Authorization": f"Bearer {ADMIN_KEY}"}
    )
    assert reply.status_code == 501
    assert reply.json() == {"error": "dynamic key registry not active"}


def test_per_model_quotas_hold_for_cached_answers_and_hide_unserved_models(
    make_cluster: Cluster, tmp_path: Path
) -> None:
    """A key whose per-model quotas do not list a model gets the same 429 for it whether
    another key of its owner cached an answer for it or nobody serves it at all."""
    full, strict = "sk-hivenet-full-key", "sk-hivenet-strict-key"
    quota = (
        "      quota:\n        per_model:\n"
        f"          {OTHER}: {{requests_per_minute_per_replica: 5, tokens_per_day: 1000}}\n"
    )
    path = auth_file(tmp_path, entry(full, "acme"), entry(strict, "acme") + quota)
    policies = tmp_path / "policies"
    policies.mkdir()
    (policies / "m.yaml").write_text(
        f"models: [{MODEL}]\nrouting_policy: {{strategy: least-loaded}}\nresponse_cache: {{}}\n"
    )
    router = make_cluster.router(
        "--auth-config-file", str(path), "--policy-model-dir", str(policies)
    )
    sim = make_cluster.sim(MODEL, "--zero-latency")
    make_cluster.agent(router, sim)
    wait_until(lambda: _models(router, full) == [MODEL])

    def chat(key: str, model: str = MODEL) -> httpx.Response:
        body = {"model": model, "temperature": 0, "messages": [{"role": "user", "content": "q"}]}
        return httpx.post(
            router.url + "/v1/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {key}"},
            timeout=20,
        )

    stored = chat(full)
    assert stored.status_code == 200 and stored.headers["X-Hivenet-Cache"] == "miss"
    assert chat(full).headers["X-Hivenet-Cache"] == "hit"
    for model in (MODEL, "nobody-serves-this"):
        refused = chat(strict, model)
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["message"] == (
            f"no quota declared for model {model} on this API key"
        )
        assert "X-Hivenet-Cache" not in refused.headers
    # The served model's refusal is counted by name; the made-up name creates no series,
    # however many a client sends.
    for n in range(20):
        assert chat(strict, f"made-up-{n}").status_code == 429
    text = router.metrics()
    assert metric(text, "hivenet_admission_rejections_total", reason="b4_rpm", model=MODEL) == 1
    assert metric(text, "hivenet_tenant_requests_failed_total", model=MODEL) == 1
    assert "made-up" not in text and "nobody-serves-this" not in text
