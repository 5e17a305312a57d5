"""Live agents, indexed by peer ID and by model, and their capacity slots."""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from hivenet_router.domain.agent import EngineSnapshot, HardwareSnapshot, Registration
from hivenet_router.router.history import smooth_rtt
from hivenet_router.router.metrics import AgentMeters, RouterMetrics
from hivenet_router.storage.history import AgentHistory
from hivenet_router.transport.link import Link

log = logging.getLogger("hivenet.router")

_order = itertools.count()


@dataclass(eq=False)
class AgentRecord:
    reg: Registration
    link: Link | None
    session_digest: bytes
    last_heartbeat: float
    registered_at: float
    meters: AgentMeters
    active: int = 0
    process_healthy: bool = True
    backend_healthy: bool = True
    engine: EngineSnapshot | None = None
    hardware: HardwareSnapshot | None = None
    last_assigned: int = field(default_factory=lambda: next(_order))
    disconnected_at: float | None = None
    draining: bool = False
    successes: int = 0
    failures: int = 0
    consecutive_failures: int = 0
    srtt_ms: float | None = None
    rttvar_ms: float | None = None
    input_tokens: int = 0
    output_tokens: int = 0
    disconnects: int = 0
    health_failures: int = 0

    def history(self) -> AgentHistory:
        return AgentHistory(
            peer_id=self.peer_id,
            successes=self.successes,
            failures=self.failures,
            input_tokens=self.input_tokens,
            output_tokens=self.output_tokens,
            disconnects=self.disconnects,
            health_failures=self.health_failures,
            srtt_ms=self.srtt_ms,
            rttvar_ms=self.rttvar_ms,
        )

    def restore(self, past: AgentHistory) -> None:
        """Warm start: earlier totals become baselines; the counters continue from them."""
        self.successes += past.successes
        self.failures += past.failures
        self.input_tokens += past.input_tokens
        self.output_tokens += past.output_tokens
        self.disconnects += past.disconnects
        self.health_failures += past.health_failures
        if self.srtt_ms is None:
            self.srtt_ms, self.rttvar_ms = past.srtt_ms, past.rttvar_ms
        self.meters.success.inc(past.successes)
        self.meters.failed.inc(past.failures)
        self.meters.input_tokens.inc(past.input_tokens)
        self.meters.output_tokens.inc(past.output_tokens)
        self._publish()

    def succeeded(self, rtt_ms: float | None) -> None:
        self.successes += 1
        self.consecutive_failures = 0
        if rtt_ms is not None:
            self.srtt_ms, self.rttvar_ms = smooth_rtt(self.srtt_ms, self.rttvar_ms, rtt_ms)
        self._publish()

    def failed(self) -> None:
        self.failures += 1
        self.consecutive_failures += 1
        self._publish()

    def _publish(self) -> None:
        if self.srtt_ms is not None and self.rttvar_ms is not None:
            self.meters.srtt.set(self.srtt_ms)
            self.meters.rttvar.set(self.rttvar_ms)
        total = self.successes + self.failures
        if total:
            self.meters.success_rate.set(self.successes / total)

    @property
    def peer_id(self) -> str:
        return self.reg.peer_id

    @property
    def model(self) -> str:
        return self.reg.model

    @property
    def capacity(self) -> int:
        return self.reg.capacity

    @property
    def connected(self) -> bool:
        return self.link is not None and not self.link.closed

    @property
    def eligible(self) -> bool:
        return (
            self.connected and self.process_healthy and self.backend_healthy and not self.draining
        )

    @property
    def load(self) -> float:
        return self.active / self.capacity

    def try_acquire(self) -> bool:
        """Take one capacity slot if one is free. Synchronous, so check and take are atomic."""
        if self.active >= self.capacity:
            return False
        self.active += 1
        self.last_assigned = next(_order)
        return True

    def release(self) -> None:
        if self.active <= 0:
            raise RuntimeError(f"slot released twice on agent {self.peer_id}")
        self.active -= 1


class Registry:
    """Agents known to this router. `on_slot` and `on_join` wake requests waiting by model."""

    def __init__(self, metrics: RouterMetrics) -> None:
        self._by_peer: dict[str, AgentRecord] = {}
        self._by_model: dict[str, dict[str, AgentRecord]] = {}
        self._metrics = metrics
        self.on_join: Callable[[str], None] = lambda model: None
        self.on_slot: Callable[[str], None] = lambda model: None

    def get(self, peer_id: str) -> AgentRecord | None:
        return self._by_peer.get(peer_id)

    def all(self) -> list[AgentRecord]:
        return list(self._by_peer.values())

    def for_model(self, model: str) -> list[AgentRecord]:
        agents = self._by_model.get(model)
        return list(agents.values()) if agents else []

    def models(self) -> dict[str, list[AgentRecord]]:
        return {model: list(agents.values()) for model, agents in self._by_model.items() if agents}

    def upsert(self, record: AgentRecord) -> AgentRecord | None:
        """Add or replace the agent with this peer ID; returns the record it replaced."""
        old = self._by_peer.get(record.peer_id)
        if old is not None:
            # The in-flight slots of the old connection still get released on the old record;
            # carry the count so the new record does not over-admit meanwhile, and keep the
            # agent's history.
            record.active = old.active
            record.successes, record.failures = old.successes, old.failures
            record.srtt_ms, record.rttvar_ms = old.srtt_ms, old.rttvar_ms
            record.input_tokens, record.output_tokens = old.input_tokens, old.output_tokens
            record.disconnects, record.health_failures = old.disconnects, old.health_failures
            self._drop(old)
        self._by_peer[record.peer_id] = record
        self._by_model.setdefault(record.model, {})[record.peer_id] = record
        reg = record.reg
        self._metrics.agent_info.labels(
            reg.peer_id,
            reg.region,
            reg.engine,
            reg.model,
            str(reg.capacity),
            reg.organization,
            reg.machine,
        ).set(1)
        self._metrics.agent_healthy.labels(reg.peer_id, reg.model).set(1)
        self.on_join(record.model)
        return old

    def remove(self, peer_id: str) -> AgentRecord | None:
        record = self._by_peer.pop(peer_id, None)
        if record is not None:
            self._drop(record)
            # Its counters go too: if the agent comes back, its history is restored from the
            # store and the counters resume from there, without counting anything twice.
            # (A replacement by upsert keeps them: the new record shares the same series.)
            labels = (record.peer_id, record.model)
            for counter in (
                self._metrics.agent_success,
                self._metrics.agent_failed,
                self._metrics.input_tokens,
                self._metrics.output_tokens,
            ):
                with contextlib.suppress(KeyError):
                    counter.remove(*labels)
        return record

    def _drop(self, record: AgentRecord) -> None:
        agents = self._by_model.get(record.model)
        if agents is not None:
            agents.pop(record.peer_id, None)
            if not agents:
                del self._by_model[record.model]
        reg = record.reg
        for metric, labels in (
            (
                self._metrics.agent_info,
                (
                    reg.peer_id,
                    reg.region,
                    reg.engine,
                    reg.model,
                    str(reg.capacity),
                    reg.organization,
                    reg.machine,
                ),
            ),
            (self._metrics.agent_healthy, (reg.peer_id, reg.model)),
            (self._metrics.capacity_utilization, (reg.peer_id, reg.model)),
            (self._metrics.agent_last_seen, (reg.peer_id,)),
            (self._metrics.srtt, (reg.peer_id, reg.model)),
            (self._metrics.rttvar, (reg.peer_id, reg.model)),
            (self._metrics.success_rate, (reg.peer_id, reg.model)),
        ):
            with contextlib.suppress(KeyError):
                metric.remove(*labels)
        for gauge in (*self._metrics.engine.values(), *self._metrics.hardware.values()):
            with contextlib.suppress(KeyError):
                gauge.remove(reg.peer_id, reg.model)

    def release(self, record: AgentRecord) -> None:
        record.release()
        current = self._by_peer.get(record.peer_id)
        if current is not None and current is not record and current.active > 0:
            current.active -= 1
        self.on_slot(record.model)
