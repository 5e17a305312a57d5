"""Events counted into Prometheus series, and state read at scrape time."""

from __future__ import annotations

from prometheus_client import generate_latest

from hivenet_router.auth.providers import Principal
from hivenet_router.domain.agent import Registration
from hivenet_router.domain.answer import Outcome
from hivenet_router.domain.errors import ErrorCode
from hivenet_router.domain.request import RequestFacts, Usage
from hivenet_router.observability.events import (
    AgentEvent,
    Ended,
    Event,
    Observers,
    Refused,
)
from hivenet_router.observability.metrics import AgentCollector, MetricsObserver, StateCollector
from hivenet_router.pipeline.ticket import Ticket
from hivenet_router.router.registry import AgentRecord
from tests.procs import metric


def ticket(observers: Observers) -> Ticket:
    t = Ticket("rid", "/v1/chat/completions", 0.0, observers)
    t.principal = Principal("acme", "k1", "n", frozenset())
    t.facts = RequestFacts("/v1/chat/completions", "m", "llm", False, None)
    return t


def text(observer: MetricsObserver) -> str:
    return generate_latest(observer.registry).decode()


def test_an_answered_request_counts_for_its_model_and_tenant() -> None:
    observer = MetricsObserver()
    t = ticket(Observers([observer]))
    t.admitted, t.dispatched, t.origin = True, True, "peer"
    t.emit(Ended(200, None, Outcome.OK, Usage(5, 7), 0.01))
    page = text(observer)
    assert metric(page, "hivenet_routing_requests_routed_total", model="m") == 1
    assert metric(page, "hivenet_tenant_requests_success_total", tenant_id="acme") == 1
    assert metric(page, "hivenet_tenant_output_tokens_total", key_id="k1") == 7
    assert metric(page, "hivenet_request_duration_seconds_count", status="200") == 1
    assert metric(page, "hivenet_routing_requests_failed_total") is None


def test_failures_refusals_and_agent_events() -> None:
    observer = MetricsObserver()
    t = ticket(Observers([observer]))
    t.emit(Refused("b4_itpm", ErrorCode.RATE_LIMIT_EXCEEDED))
    t.emit(Refused("daily", ErrorCode.TOKEN_LIMIT_EXCEEDED))
    broken = ticket(Observers([observer]))
    broken.admitted, broken.dispatched = True, True
    broken.emit(Ended(200, ErrorCode.BACKEND_ERROR, Outcome.BROKEN, None, 0.5))
    Observers([observer]).on_agent(AgentEvent("disconnected", "peer", "m"))
    page = text(observer)
    assert metric(page, "hivenet_admission_rejections_total", reason="b4_itpm") == 1
    assert metric(page, "hivenet_admission_rejections_total", reason="daily") is None
    assert metric(page, "hivenet_tenant_rate_limited_total") == 1
    assert metric(page, "hivenet_tenant_token_limited_total") == 1
    assert metric(page, "hivenet_routing_requests_failed_total", code="backend_error") == 1
    assert metric(page, "hivenet_tenant_requests_failed_total") == 1
    assert metric(page, "hivenet_agent_disconnections_total", peer_id="peer") == 1


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


def test_agents_and_state_are_read_at_scrape_time() -> None:
    observer = MetricsObserver()
    reg = Registration(peer_id="p", model="m", capability="llm", engine="vllm", capacity=4)
    agent = AgentRecord(reg=reg, link=None, last_heartbeat=0.0, registered_at=0.0)
    agents = [agent]
    observer.add(AgentCollector(lambda: [(a, 0) for a in agents]))
    observer.add(
        StateCollector(
            occupancy=lambda: [("m", 120, 2)],
            limits=lambda: [("m", (900, 8))],
            waiting=lambda: [("m", 3)],
            pending=lambda: (1, 5),
        )
    )
    agent.active = 2
    agent.finished(True, 10.0, Usage(3, 4))
    page = text(observer)
    assert metric(page, "hivenet_routing_agent_healthy", peer_id="p") == 0  # not connected
    assert metric(page, "hivenet_agent_capacity_utilization", peer_id="p") == 0.5
    assert metric(page, "hivenet_agent_requests_success_total", peer_id="p") == 1
    assert metric(page, "hivenet_agent_output_tokens_total", peer_id="p") == 4
    assert metric(page, "hivenet_admission_occupancy_tokens", model="m") == 120
    assert metric(page, "hivenet_queue_depth", model="m") == 3
    assert metric(page, "hivenet_router_active_forwards") == 5
    agents.clear()  # removed: its series go with it
    assert metric(text(observer), "hivenet_routing_agent_healthy") is None
