"""The health monitor: heartbeats decide liveness; silence marks an agent unhealthy, then
removes it."""

from __future__ import annotations

import logging
from collections.abc import Callable

from hivenet_router.clock import Clock
from hivenet_router.observability.events import AgentEvent, Observers
from hivenet_router.router.registry import AgentRecord, Registry

log = logging.getLogger("hivenet.router")


class HealthMonitor:
    def __init__(
        self,
        registry: Registry,
        observers: Observers,
        clock: Clock,
        *,
        unhealthy_after: float,
        remove_after: float,
        on_remove: Callable[[AgentRecord], None],
    ) -> None:
        self.registry = registry
        self.observers = observers
        self.clock = clock
        self.unhealthy_after = unhealthy_after
        self.remove_after = remove_after
        self.on_remove = on_remove

    def sweep(self) -> None:
        """One pass: mark silent agents unhealthy, remove long-silent ones."""
        now = self.clock.monotonic()
        for record in self.registry.all():
            silent = now - record.last_heartbeat
            if silent > self.remove_after:
                # Recheck against the live record: it may have re-registered meanwhile.
                current = self.registry.get(record.peer_id)
                if current is not record or now - current.last_heartbeat <= self.remove_after:
                    continue
                log.warning(
                    "removing agent %s (%s): no heartbeat for %.1fs",
                    record.peer_id,
                    record.model,
                    silent,
                )
                self.registry.remove(record.peer_id)
                if record.removed_silent():
                    # Silent on a connection that is still open; a dropped connection was
                    # counted when it dropped, and must not be counted again here.
                    self.observers.on_agent(
                        AgentEvent("disconnected", record.peer_id, record.model)
                    )
                self.on_remove(record)
            elif silent > self.unhealthy_after and record.process_healthy:
                log.warning(
                    "agent %s (%s) unhealthy: no heartbeat for %.1fs",
                    record.peer_id,
                    record.model,
                    silent,
                )
                record.went_silent()
                self.observers.on_agent(AgentEvent("unhealthy", record.peer_id, record.model))
                if record.backend_healthy:  # else it was unhealthy already
                    self.registry.announce("unhealthy", record)
