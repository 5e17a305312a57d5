"""Live agents, indexed by peer ID and by model, their capacity slots and their history.

The registry knows nothing of who waits for agents: whoever does (dispatch) subscribes with
`watch` and is told which model gained room (an agent joined, recovered or was undrained).
Whoever follows registrations (the admin registration stream) subscribes with `listen` and
is told each change by name (`announce`); parts that change an agent's state (the control
plane, the health monitor, the admin API, routing) do it through its record's methods, the
only writers of a record, and announce it here.
Metrics read the records at scrape time; nothing here counts for them.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from hivenet_router.domain.agent import (
    EngineHistograms,
    EngineSnapshot,
    HardwareSnapshot,
    Heartbeat,
    Registration,
)
from hivenet_router.domain.request import Usage
from hivenet_router.storage.history import AgentHistory
from hivenet_router.transport.link import Link

log = logging.getLogger("hivenet.router")

_order = itertools.count()
_COLD = -(1 << 62)  # last_served after a failure: below every agent that has not failed

# RFC 6298 smoothing of router-observed times from forwarding a request to its answer's head.
ALPHA = 1 / 8
BETA = 1 / 4


def smooth_rtt(srtt: float | None, rttvar: float | None, sample: float) -> tuple[float, float]:
    """Fold one round-trip sample (ms) into (SRTT, RTTVAR)."""
    if srtt is None or rttvar is None:
        return sample, sample / 2
    rttvar = (1 - BETA) * rttvar + BETA * abs(srtt - sample)
    srtt = (1 - ALPHA) * srtt + ALPHA * sample
    return srtt, rttvar


@dataclass(eq=False)
class AgentRecord:
    reg: Registration
    link: Link | None
    last_heartbeat: float
    registered_at: float
    # This router's slots on the agent: taken and given back here only, so it stays exact.
    held: int = 0
    # Requests in flight on the agent from every router of the site, as its last heartbeat
    # said (0 when it says nothing: an older agent, or one that serves this router alone).
    reported: int = 0
    # The routers of the site the agent has a session with (None: it does not say).
    routers_up: tuple[str, ...] | None = None
    # The record of the agent's next connection, which took over this one's slots in use
    # (`carry`): a slot given back here is given back there too. None once removed.
    successor: AgentRecord | None = None
    process_healthy: bool = True
    backend_healthy: bool = True
    engine: EngineSnapshot | None = None
    hardware: HardwareSnapshot | None = None
    histograms: EngineHistograms | None = None  # from heartbeats, for metrics only
    last_assigned: int = field(default_factory=lambda: next(_order))
    # Least-loaded's warm tie-break (`served`): order of the last success here. One that
    # never served ranks below all that did (negative; earlier joiners higher).
    last_served: int = field(default_factory=lambda: -next(_order))
    disconnected_at: float | None = None
    last_seen_wall: float | None = None
    draining: bool = False
    # The agent said it is shutting down (a heartbeat's `stopping`): like a drain, but the
    # agent's own, and not carried to its next connection.
    stopping: bool = False
    successes: int = 0
    failures: int = 0
    consecutive_failures: int = 0
    srtt_ms: float | None = None
    rttvar_ms: float | None = None
    input_tokens: int = 0
    output_tokens: int = 0
    disconnects: int = 0
    health_failures: int = 0
    backend_failures: int = 0  # times it reported its backend unhealthy
    rejected: int = 0  # times a request wanted a slot while it was full
    # Adaptive concurrency's limit below the declared capacity; 0 when it is off.
    slot_limit: int = 0
    # Copied from the registration, which never changes for a record (a new registration
    # makes a new record): plain attributes, read many times per request by routing.
    peer_id: str = field(init=False)
    model: str = field(init=False)
    capacity: int = field(init=False)

    def __post_init__(self) -> None:
        self.peer_id, self.model, self.capacity = (
            self.reg.peer_id,
            self.reg.model,
            self.reg.capacity,
        )

    def history(self) -> AgentHistory:
        return AgentHistory(
            peer_id=self.peer_id,
            successes=self.successes,
            failures=self.failures,
            input_tokens=self.input_tokens,
            output_tokens=self.output_tokens,
            disconnects=self.disconnects,
            health_failures=self.health_failures,
            backend_failures=self.backend_failures,
            rejected=self.rejected,
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
        self.backend_failures += past.backend_failures
        self.rejected += past.rejected
        if self.srtt_ms is None:
            self.srtt_ms, self.rttvar_ms = past.srtt_ms, past.rttvar_ms

    def carry(self, old: AgentRecord) -> None:
        """A new connection of the same agent: keep its slots in use, its history, and an
        operator's drain (a reconnect must not undo it)."""
        old.successor = self
        self.draining = self.draining or old.draining
        self.held, self.reported = old.held, old.reported
        self.successes, self.failures = old.successes, old.failures
        self.srtt_ms, self.rttvar_ms = old.srtt_ms, old.rttvar_ms
        self.input_tokens, self.output_tokens = old.input_tokens, old.output_tokens
        self.disconnects, self.health_failures = old.disconnects, old.health_failures
        self.backend_failures, self.rejected = old.backend_failures, old.rejected
        self.slot_limit = old.slot_limit
        self.last_assigned, self.last_served = old.last_assigned, old.last_served

    def served(self, ok: bool | None) -> None:
        """For least-loaded's ties: a success makes the agent the warmest, a failure the
        coldest (so a retry or the next step goes elsewhere first); the client's doing
        changes nothing."""
        if ok:
            self.last_served = next(_order)
        elif ok is False:
            self.last_served = _COLD

    def finished(self, ok: bool | None, rtt_ms: float | None, usage: Usage | None) -> None:
        """The one writer of per-request statistics: `ok` True for a success, False for a
        failure, None for neither (the client's mistake, or the client went away)."""
        if usage is not None:
            self.input_tokens += usage.input_tokens
            self.output_tokens += usage.output_tokens
        if ok is None:
            return
        if ok:
            self.successes += 1
            self.consecutive_failures = 0
            if rtt_ms is not None:
                self.srtt_ms, self.rttvar_ms = smooth_rtt(self.srtt_ms, self.rttvar_ms, rtt_ms)
        else:
            self.failures += 1
            self.consecutive_failures += 1

    @property
    def connected(self) -> bool:
        return self.link is not None and not self.link.closed

    @property
    def eligible(self) -> bool:
        return (
            self.connected
            and self.process_healthy
            and self.backend_healthy
            and not self.draining
            and not self.stopping
        )

    @property
    def limit(self) -> int:
        """Slots routing may fill now: the capacity, or the adaptive limit below it."""
        limit = self.slot_limit
        return limit if 0 < limit < self.capacity else self.capacity

    @property
    def active(self) -> int:
        """Requests in flight on the agent as routing reads them (ranking, the capacity
        check, gates): the larger of the agent's own count from every router and this
        router's slots, so the routers of a site spread work by the agent's real load."""
        return max(self.held, self.reported)

    @property
    def load(self) -> float:
        return self.active / self.capacity

    def try_acquire(self) -> bool:
        """Take one slot if the agent has one free. Synchronous, so check and take are
        atomic."""
        if self.active >= self.limit:
            self.turned_away()
            return False
        self.held += 1
        self.last_assigned = next(_order)
        return True

    def release(self) -> None:
        if self.held <= 0:
            raise RuntimeError(f"slot released twice on agent {self.peer_id}")
        self.held -= 1

    def turned_away(self) -> None:
        """A request wanted a slot while the agent was full."""
        self.rejected += 1

    def limit_slots(self, limit: int) -> None:
        """Adaptive concurrency's limit below the capacity; 0 gives the whole capacity."""
        self.slot_limit = limit

    # -- what the control plane, the health monitor and the admin API learn ----------------

    def heard(self, beat: Heartbeat, now: float, wall: float) -> bool:
        """A heartbeat at `now` (monotonic; `wall` for people): the agent is alive, and says
        how its backend is, what every router has in flight on it, the routers it has a
        session with and its engine's snapshots. True when its backend just went down."""
        self.last_heartbeat = now
        self.process_healthy = True
        went_down = self.backend_healthy and not beat.backend_healthy
        if went_down:
            self.backend_failures += 1
        self.backend_healthy = beat.backend_healthy
        # What every router has in flight on it; routing takes the larger of this and its own.
        self.reported = beat.inflight_total or 0
        self.routers_up = tuple(beat.routers_up) if beat.routers_up is not None else None
        self.stopping = self.stopping or beat.stopping  # an agent that stops never takes it back
        self.sampled(beat.engine, beat.hardware)
        if beat.histograms is not None:
            self.histograms = beat.histograms
        self.last_seen_wall = wall
        return went_down

    def sampled(self, engine: EngineSnapshot | None, hardware: HardwareSnapshot | None) -> None:
        """The engine's and the host's latest samples (from a heartbeat or a routing
        signal); a part the agent did not send keeps its last value."""
        if engine is not None:
            self.engine = engine
        if hardware is not None:
            self.hardware = hardware

    def went_silent(self) -> None:
        """No heartbeat for too long: unhealthy until the next one."""
        self.process_healthy = False
        self.health_failures += 1

    def disconnected(self, now: float) -> None:
        """Its connection dropped at `now`."""
        self.disconnected_at = now
        self.disconnects += 1

    def removed_silent(self) -> bool:
        """Removed for silence: a disconnection, unless its connection's drop was counted
        already. True when this one counts."""
        if self.disconnected_at is not None:
            return False
        self.disconnects += 1
        return True

    def drain(self, draining: bool) -> bool:
        """An operator drains the agent (no new requests; those in flight finish) or lets
        it serve again. True when that changed something."""
        if self.draining == draining:
            return False
        self.draining = draining
        return True


Watcher = Callable[[str], None]
Listener = Callable[[str, AgentRecord], None]


class Registry:
    """Agents known to this router."""

    def __init__(self) -> None:
        self._by_peer: dict[str, AgentRecord] = {}
        self._by_model: dict[str, dict[str, AgentRecord]] = {}
        self._watchers: list[Watcher] = []
        self._listeners: list[Listener] = []

    def watch(self, watcher: Watcher) -> None:
        """Call `watcher(model)` whenever a model may have gained an eligible agent."""
        self._watchers.append(watcher)

    def listen(self, listener: Listener) -> None:
        """Call `listener(change, record)` on every registration change: `registered`,
        `updated` (the same peer ID registered again), `unhealthy`, `healthy`, `drained`,
        `undrained`, `stopping` (the agent is shutting down), `disconnected`, `unregistered`
        (removed from the registry)."""
        self._listeners.append(listener)

    def announce(self, change: str, record: AgentRecord) -> None:
        for listener in self._listeners:
            try:
                listener(change, record)
            except Exception:  # a follower's fault must never undo a registration
                log.exception("registration listener failed on %s of %s", change, record.peer_id)

    def changed(self, model: str) -> None:
        for watcher in self._watchers:
            watcher(model)

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
            # carry the count so the new record does not over-admit meanwhile.
            record.carry(old)
            self._drop(old)
        self._by_peer[record.peer_id] = record
        self._by_model.setdefault(record.model, {})[record.peer_id] = record
        self.changed(record.model)
        self.announce("registered" if old is None else "updated", record)
        return old

    def remove(self, peer_id: str) -> AgentRecord | None:
        record = self._by_peer.pop(peer_id, None)
        if record is not None:
            self._drop(record)
            self.announce("unregistered", record)
        return record

    def _drop(self, record: AgentRecord) -> None:
        agents = self._by_model.get(record.model)
        if agents is not None:
            agents.pop(record.peer_id, None)
            if not agents:
                del self._by_model[record.model]

    def release(self, record: AgentRecord) -> None:
        """Give back one slot taken on `record`, and on every later connection of the agent
        that took its slots over. A record that was removed handed nothing over: a new
        registration of the same peer starts with its own count."""
        record.release()
        successor = record.successor
        while successor is not None:
            if successor.held > 0:
                successor.held -= 1
            successor = successor.successor
