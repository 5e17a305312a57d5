from __future__ import annotations

from hivenet_router.clock import ManualClock
from hivenet_router.domain.agent import Registration
from hivenet_router.observability.events import AgentEvent, Observers
from hivenet_router.router.health import HealthMonitor
from hivenet_router.router.registry import AgentRecord, Registry


class Heard:
    def __init__(self) -> None:
        self.events: list[AgentEvent] = []

    def on_event(self, ticket: object, event: object) -> None:
        pass

    def on_agent(self, event: AgentEvent) -> None:
        self.events.append(event)


def record(peer: str, now: float) -> AgentRecord:
    reg = Registration(peer_id=peer, model="m", capability="llm", engine="vllm", capacity=1)
    return AgentRecord(reg=reg, link=None, last_heartbeat=now, registered_at=0.0)


def monitor(
    registry: Registry, clock: ManualClock, heard: Heard, removed: list[str]
) -> HealthMonitor:
    return HealthMonitor(
        registry,
        Observers([heard]),
        clock,
        unhealthy_after=15,
        remove_after=30,
        on_remove=lambda r: removed.append(r.peer_id),
    )


def test_the_health_monitor_marks_then_removes() -> None:
    clock, registry, heard, removed = ManualClock(), Registry(), Heard(), []
    agent = record("a", clock.monotonic())
    registry.upsert(agent)
    sweeper = monitor(registry, clock, heard, removed)
    clock.advance(10)
    sweeper.sweep()
    assert agent.process_healthy
    clock.advance(6)
    sweeper.sweep()
    assert not agent.process_healthy and registry.get("a") is agent
    clock.advance(15)
    sweeper.sweep()
    assert registry.get("a") is None and removed == ["a"]
    assert [e.kind for e in heard.events] == ["unhealthy", "disconnected"]


def test_a_dropped_connection_is_not_counted_again_at_removal() -> None:
    clock, registry, heard, removed = ManualClock(), Registry(), Heard(), []
    agent = record("a", clock.monotonic())
    agent.disconnected_at = clock.monotonic()  # counted by the control plane when it dropped
    registry.upsert(agent)
    clock.advance(31)
    monitor(registry, clock, heard, removed).sweep()
    assert removed == ["a"] and [e.kind for e in heard.events] == []


def test_the_health_monitor_spares_a_reregistered_agent() -> None:
    clock, registry, heard, removed = ManualClock(), Registry(), Heard(), []
    registry.upsert(record("a", clock.monotonic()))
    sweeper = monitor(registry, clock, heard, removed)
    clock.advance(31)
    registry.upsert(record("a", clock.monotonic()))
    sweeper.sweep()
    assert registry.get("a") is not None and removed == []
