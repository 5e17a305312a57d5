"""/metrics against the reference: every documented name, type and label set.

The reference list (tests/data/reference_metrics.json) was taken from the reference's
observability pages. A router with tenants on quotas serves a few requests of every kind;
its scrape must then carry each documented family with the documented type, and every
sample must carry exactly the documented labels, save for the differences that
docs/observability.md lists (and this file repeats)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.test_auth import entry
from tests.procs import Router, cluster, wait_until

REFERENCE = Path(__file__).parent.parent / "data" / "reference_metrics.json"
MODEL = "metered"
RPM_KEY, BUDGET_KEY, PER_MODEL_KEY = "sk-metrics-rpm", "sk-metrics-budget", "sk-metrics-model"

# Exported only by a router of a site (--sync-store=valkey); tests/integration/test_site.py
# checks them there.
SITE_ONLY = {"hivenet_sync_peers"}
# Labels kept beyond the reference's (docs/observability.md says why).
EXTRA = {
    "hivenet_routing_requests_failed_total": {"code"},
    "hivenet_policy_fallback_routed_total": {"step"},
    "hivenet_policy_provider_fallback_total": {"provider"},
}


def reference() -> list[dict[str, object]]:
    data = json.loads(REFERENCE.read_text())
    metrics: list[dict[str, object]] = data["metrics"]
    return metrics


@pytest.fixture(scope="module")
def scraped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp: Path = tmp_path_factory.mktemp("metrics")
    with cluster(tmp) as c:
        auth = tmp / "auth.yaml"
        auth.write_text(
            "api:\n  mode: api-key\n  keys:\n"
            + entry(RPM_KEY, "rpm-tenant")
            + "      quota: {requests_per_minute: 2}\n"
            + entry(BUDGET_KEY, "budget-tenant")
            + "      quota: {tokens_per_day: 100000}\n"
            + entry(PER_MODEL_KEY, "model-tenant")
            + f"      quota:\n        per_model:\n          {MODEL}:"
            " {requests_per_minute_per_replica: 100, tokens_per_day: 100000}\n"
            + "admin:\n  mode: api-key\n"
        )
        router = c.router("--auth-config-file", str(auth))
        c.agent(router, c.sim(MODEL, "--zero-latency"), "--deployment-id", "dep-a")
        wait_until(lambda: MODEL in _models(router, BUDGET_KEY))
        traffic(router)
        # Engine histograms travel with heartbeats (300 ms in tests): wait for one.
        wait_until(lambda: "hivenet_agent_engine_request_success_total{" in router.metrics())
        yield router.metrics()


def _models(router: Router, key: str) -> str:
    return httpx.get(
        router.url + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=5
    ).text


def traffic(router: Router) -> None:
    """A little of everything: answers, a stream, refusals, an unknown model, a bad route."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    with httpx.Client(base_url=router.url, timeout=10) as http:
        for key in (BUDGET_KEY, PER_MODEL_KEY, RPM_KEY, RPM_KEY, RPM_KEY):
            http.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})
        streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
        with http.stream(
            "POST",
            "/v1/chat/completions",
            json=streamed,
            headers={"Authorization": f"Bearer {BUDGET_KEY}"},
        ) as reply:
            reply.read()
        unknown = {**body, "model": "made-up-by-a-client"}
        http.post(
            "/v1/chat/completions", json=unknown, headers={"Authorization": f"Bearer {BUDGET_KEY}"}
        )
        http.request("PROPFIND", "/no/such/route")


def families(text: str) -> dict[str, tuple[str, set[frozenset[str]]]]:
    """Exposed name (counters with `_total`) -> (type, the label sets its samples carry)."""
    found: dict[str, tuple[str, set[frozenset[str]]]] = {}
    for family in text_string_to_metric_families(text):
        name = family.name + "_total" if family.type == "counter" else family.name
        sets = {frozenset(set(sample.labels) - {"le"}) for sample in family.samples}
        found[name] = (family.type, sets)
    return found


def test_every_reference_metric_is_exported_with_its_type(scraped: str) -> None:
    exported = families(scraped)
    missing = [m["name"] for m in reference() if m["name"] not in exported]
    assert sorted(set(missing) - SITE_ONLY) == []
    wrong = [
        (m["name"], m["type"], exported[str(m["name"])][0])
        for m in reference()
        if m["name"] in exported and exported[str(m["name"])][0] != m["type"]
    ]
    assert wrong == []


def test_every_sample_carries_the_reference_labels(scraped: str) -> None:
    exported = families(scraped)
    differ = []
    with_samples = 0
    for m in reference():
        name = str(m["name"])
        if name not in exported:
            continue
        wanted = frozenset(m["labels"]) | EXTRA.get(name, set())  # type: ignore[arg-type]
        for labels in exported[name][1]:
            with_samples += 1
            if labels != wanted:
                differ.append((name, sorted(labels), sorted(wanted)))
    assert differ == []
    assert with_samples >= 40  # the traffic above filled most families


def test_the_traffic_reached_the_families_it_should(scraped: str) -> None:
    for name in (
        "hivenet_routing_requests_routed_total",
        "hivenet_tenant_requests_success_total",
        "hivenet_tenant_rate_limited_total",
        "hivenet_tenant_quota_rpm_limit",
        "hivenet_tenant_per_model_quota_rpm_limit",
        "hivenet_tenant_tokens_used_today",
        "hivenet_tenant_last_request_timestamp",
        "hivenet_request_duration_seconds",
        "http_server_request_duration_seconds",
        "hivenet_agent_cpu_usage_percent",
        "hivenet_agent_memory_total_bytes",
        "hivenet_agent_engine_ttft_seconds",
        "hivenet_agent_engine_request_generation_tokens",
        "hivenet_agent_engine_request_success_total",
    ):
        assert families(scraped)[name][1], f"{name} has no samples"
    assert 'deployment_id="dep-a"' in scraped


def test_no_label_value_comes_from_the_client(scraped: str) -> None:
    assert "made-up-by-a-client" not in scraped
    assert "PROPFIND" not in scraped and "/no/such/route" not in scraped
    assert 'method="OTHER",route="unmatched"' in scraped
