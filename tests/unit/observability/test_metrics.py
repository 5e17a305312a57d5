"""Events counted into Prometheus series, in the reference's names and label sets."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from hivenet_router.auth.config import ModelQuota, Quota
from hivenet_router.auth.providers import Principal
from hivenet_router.domain.agent import Registration
from hivenet_router.domain.answer import Outcome
from hivenet_router.domain.errors import ErrorCode
from hivenet_router.domain.request import Job, RequestFacts, Usage
from hivenet_router.observability import metrics
from hivenet_router.observability.events import (
    AgentEvent,
    Ended,
    Event,
    Observers,
    Refused,
)
from hivenet_router.observability.metrics import MetricsObserver
from hivenet_router.pipeline.ticket import Ticket
from tests.procs import metric


def ticket(observers: Observers) -> Ticket:
    t = Ticket("rid", "/v1/chat/completions", 0.0, observers)
    t.principal = Principal("acme", "k1", "n", frozenset())
    t.facts = RequestFacts("/v1/chat/completions", "m", "llm", False, None)
    t.job = Job("/v1/chat/completions", "m", "llm", False, b"{}", [])
    return t


def text(observer: MetricsObserver) -> str:
    return generate_latest(observer.registry).decode()


def test_an_answered_request_counts_for_its_model_and_tenant() -> None:
    observer = MetricsObserver()
    t = ticket(Observers([observer]))
    t.admitted, t.dispatched, t.origin = True, True, "peer"
    t.agent = Registration(
        peer_id="peer",
        model="m",
        capability="llm",
        engine="vllm",
        capacity=4,
        region="eu",
        deployment_id="dep-1",
    )
    t.method = "POST"
    t.emit(Ended(200, None, Outcome.OK, Usage(5, 7), 0.01))
    page = text(observer)
    assert (
        metric(
            page,
            "hivenet_routing_requests_routed_total",
            region="eu",
            engine="vllm",
            tenant_id="acme",
        )
        == 1
    )
    assert metric(page, "hivenet_tenant_requests_success_total", deployment_id="dep-1") == 1
    assert metric(page, "hivenet_tenant_output_tokens_total", key_id="k1") == 7
    assert (
        metric(
            page,
            "http_server_request_duration_seconds_count",
            method="POST",
            route="/v1/chat/completions",
            status_code="200",
        )
        == 1
    )
    assert (
        metric(page, "hivenet_request_duration_seconds_count", peer_id="peer", status_code="200")
        == 1
    )
    assert metric(page, "hivenet_tenant_request_duration_seconds_count", model="m") == 1
    assert metric(page, "hivenet_tenant_last_request_timestamp", tenant_id="acme") is not None
    assert metric(page, "hivenet_routing_requests_failed_total") is None
    assert metric(page, "process_resident_memory_bytes") is not None


def test_failures_and_refusals() -> None:
    observer = MetricsObserver()
    t = ticket(Observers([observer]))
    t.emit(Refused("b4_itpm", ErrorCode.RATE_LIMIT_EXCEEDED))
    t.emit(Refused("b4_rpm", ErrorCode.RATE_LIMIT_EXCEEDED))
    t.emit(Refused("daily", ErrorCode.TOKEN_LIMIT_EXCEEDED))
    t.emit(Ended(429, ErrorCode.RATE_LIMIT_EXCEEDED, None, None, 0.0))
    broken = ticket(Observers([observer]))
    broken.admitted, broken.dispatched = True, True
    broken.emit(Ended(200, ErrorCode.BACKEND_ERROR, Outcome.BROKEN, None, 0.5))
    page = text(observer)
    assert metric(page, "hivenet_admission_rejections_total", reason="b4_itpm") == 1
    assert metric(page, "hivenet_admission_rejections_total", reason="daily") is None
    assert metric(page, "hivenet_tenant_rate_limited_total", tenant_id="acme") == 1  # rpm only
    assert (
        metric(page, "hivenet_tenant_token_limited_total", phase="input", deployment_id="unset")
        == 1
    )
    assert metric(page, "hivenet_routing_requests_failed_total", code="backend_error") == 1
    # The refused request counts for its tenant too, before any agent was chosen.
    assert metric(page, "hivenet_tenant_requests_failed_total", deployment_id="unset") == 2


def test_requests_for_unknown_models_count_only_as_http() -> None:
    observer = MetricsObserver()
    t = ticket(Observers([observer]))
    t.job = None  # refused before the router knew the model (a 404, a 403, a bad body)
    t.emit(Ended(404, ErrorCode.MODEL_NOT_FOUND, None, None, 0.0))
    page = text(observer)
    assert metric(page, "http_server_request_duration_seconds_count", status_code="404") == 1
    assert metric(page, "hivenet_tenant_requests_failed_total") is None


def test_quota_ceilings_appear_with_a_tenants_requests() -> None:
    observer = MetricsObserver(replicas=lambda model: 3)
    flat = ticket(Observers([observer]))
    flat.principal = Principal(
        "acme", "k1", "n", frozenset(), Quota(requests_per_minute=60, tokens_per_day=1000)
    )
    flat.emit(Ended(200, None, Outcome.OK, None, 0.0))
    per_model = ticket(Observers([observer]))
    per_model.principal = Principal(
        "beta", "", "n", frozenset(), Quota(per_model={"m": ModelQuota(10, 500)})
    )
    per_model.emit(Ended(200, None, Outcome.OK, None, 0.0))
    page = text(observer)
    assert metric(page, "hivenet_tenant_quota_rpm_limit", tenant_id="acme") == 60
    assert metric(page, "hivenet_tenant_quota_tpd_limit", tenant_id="acme") == 1000
    assert metric(page, "hivenet_tenant_per_model_quota_rpm_limit", tenant_id="beta") == 30
    assert metric(page, "hivenet_tenant_per_model_quota_tpd_limit", model="m") == 500


def test_a_quota_taken_away_leaves_no_ceiling_behind() -> None:
    observer = MetricsObserver()
    limited = ticket(Observers([observer]))
    limited.principal = Principal(
        "acme", "k1", "n", frozenset(), Quota(requests_per_minute=60, tokens_per_day=1000)
    )
    limited.emit(Ended(200, None, Outcome.OK, None, 0.0))
    assert metric(text(observer), "hivenet_tenant_quota_rpm_limit", tenant_id="acme") == 60
    unlimited = ticket(Observers([observer]))  # the same key after a reload: no limits
    unlimited.principal = Principal("acme", "k1", "n", frozenset(), Quota())
    unlimited.emit(Ended(200, None, Outcome.OK, None, 0.0))
    page = text(observer)
    assert metric(page, "hivenet_tenant_requests_success_total", tenant_id="acme") == 2
    assert metric(page, "hivenet_tenant_quota_rpm_limit", tenant_id="acme") is None
    assert metric(page, "hivenet_tenant_quota_tpd_limit", tenant_id="acme") is None


def test_a_reload_moves_the_ceilings_shown_at_once() -> None:
    """They changed only at each tenant's next request (found by a new user)."""
    observer = MetricsObserver(replicas=lambda model: 3)
    for tenant, quota in [
        ("acme", Quota(requests_per_minute=50, tokens_per_day=300)),
        ("beta", Quota(per_model={"m": ModelQuota(10, 500)})),
    ]:
        one = ticket(Observers([observer]))
        one.principal = Principal(tenant, "k1", "n", frozenset(), quota)
        one.emit(Ended(200, None, Outcome.OK, None, 0.0))
    observer.tenants.reloaded(
        {
            "acme": Quota(requests_per_minute=0, tokens_per_day=999),
            "beta": Quota(per_model={"m": ModelQuota(10, 700)}),
        }
    )
    page = text(observer)
    assert metric(page, "hivenet_tenant_quota_rpm_limit", tenant_id="acme") is None
    assert metric(page, "hivenet_tenant_quota_tpd_limit", tenant_id="acme") == 999
    assert metric(page, "hivenet_tenant_per_model_quota_tpd_limit", tenant_id="beta") == 700
    observer.tenants.reloaded({})  # their keys are gone
    page = text(observer)
    assert metric(page, "hivenet_tenant_quota_tpd_limit", tenant_id="acme") is None
    assert metric(page, "hivenet_tenant_per_model_quota_tpd_limit", tenant_id="beta") is None
    assert metric(page, "hivenet_tenant_per_model_quota_rpm_limit", tenant_id="beta") is None


def test_provider_calls_are_timed_by_status() -> None:
    observer = MetricsObserver()
    observer.provider_call("openai", 200, 0.2)
    observer.provider_call("openai", 0, 1.0)
    page = text(observer)
    assert (
        metric(
            page, "http_client_request_duration_seconds_count", provider="openai", status_code="0"
        )
        == 1
    )


def test_a_failing_observer_never_breaks_the_others() -> None:
    seen: list[Event] = []

    class Broken:
        def on_event(self, ticket: Ticket, event: Event) -> None:
            raise RuntimeError("bug")

        def on_agent(self, event: AgentEvent) -> None:
            raise RuntimeError("bug")

    class Recorder:
        def on_event(self, ticket: Ticket, event: Event) -> None:
            seen.append(event)

        def on_agent(self, event: AgentEvent) -> None:
            pass

    observers = Observers([Broken(), Recorder()])
    ticket(observers).emit(Ended(200, None, None, None, 0.0))
    observers.on_agent(AgentEvent("unhealthy", "p", "m"))
    assert len(seen) == 1


def test_requests_of_one_kind_add_to_the_same_series_and_the_row_table_is_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(metrics, "ROWS", 2)
    observer = MetricsObserver()
    observers = Observers([observer])

    def answered(tenant: str, usage: Usage | None) -> None:
        t = ticket(observers)
        t.principal = Principal(tenant, "k1", "n", frozenset())
        t.admitted, t.dispatched, t.origin, t.method = True, True, "peer", "POST"
        t.emit(Ended(200, None, Outcome.OK, usage, 0.02))

    answered("acme", None)
    page = text(observer)
    assert metric(page, "hivenet_tenant_requests_success_total", tenant_id="acme") == 1
    # No usage reported yet: the token series do not show the tenant at all.
    assert metric(page, "hivenet_tenant_input_tokens_total", tenant_id="acme") is None
    answered("acme", Usage(3, 4))
    answered("acme", Usage(5, 6))
    # Three more kinds of request than the table keeps: it starts again, counts go on.
    for tenant in ("b", "c", "d"):
        answered(tenant, Usage(1, 1))
    answered("acme", Usage(1, 1))
    page = text(observer)
    assert metric(page, "hivenet_tenant_requests_success_total", tenant_id="acme") == 4
    assert metric(page, "hivenet_tenant_input_tokens_total", tenant_id="acme") == 9
    assert metric(page, "hivenet_tenant_output_tokens_total", tenant_id="acme") == 11
    assert metric(page, "hivenet_tenant_requests_success_total", tenant_id="d") == 1
    assert metric(page, "hivenet_routing_requests_routed_total", tenant_id="acme", region="") == 4
    assert metric(page, "hivenet_request_duration_seconds_count", tenant_id="acme") == 4
    assert metric(page, "hivenet_request_duration_seconds_sum", tenant_id="acme") == pytest.approx(
        0.08
    )
    assert len(observer._rows) <= 2
