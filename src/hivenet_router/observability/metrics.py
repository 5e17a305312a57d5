"""The router's Prometheus metrics, in the Go router's names, as an observer.

Counters and histograms of what happens to requests are fed by events (nothing on the
request path calls them directly). What is a state rather than an event (agents and their
statistics, occupancy, queues) is read at scrape time from the objects that hold it, so the
request path pays nothing for it and a series can never go stale.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hivenet_router.domain.agent import EngineSnapshot, HardwareSnapshot, Registration
from hivenet_router.domain.answer import Outcome
from hivenet_router.domain.errors import ErrorCode
from hivenet_router.observability.events import (
    AgentEvent,
    AnswerHead,
    Attempt,
    Ended,
    Event,
    Exhausted,
    Queued,
    Refused,
)
from hivenet_router.observability.series import CounterSeries, HistogramSeries, SeriesCollector
from hivenet_router.pipeline.ticket import Ticket

_AGENT_INFO = ("peer_id", "region", "engine", "model", "capacity", "organization", "machine")
ENGINE_GAUGES = (
    "kv_cache_utilization",
    "running_requests",
    "waiting_requests",
    "preemptions_total",
    "avg_ttft_seconds",
    "p90_ttft_seconds",
    "avg_itl_seconds",
    "p90_itl_seconds",
)
_TENANT = ("tenant_id", "key_id", "model")


class MetricsObserver:
    """Request and agent events counted into Prometheus series."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        c, h = CounterSeries, HistogramSeries
        self.routed = c(
            "hivenet_routing_requests_routed", "Requests answered by an agent", ("model",)
        )
        self.failed = c(
            "hivenet_routing_requests_failed",
            "Requests that ended in a router error",
            ("model", "code"),
        )
        self.disconnections = c(
            "hivenet_agent_disconnections", "Agent connections lost or removed", ("peer_id",)
        )
        self.agent_failure = c(
            "hivenet_agent_failure", "Agents marked unhealthy after missed heartbeats", ("peer_id",)
        )
        self.backend_failure = c(
            "hivenet_model_backend_failure",
            "Agents that reported their backend unhealthy",
            ("model",),
        )
        self.connection_resets = c(
            "hivenet_agent_connection_resets",
            "Forwards retried because a connection was stale",
            ("peer_id",),
        )
        self.queue_wait = h(
            "hivenet_queue_wait_seconds", "Time spent waiting for agent capacity", ("model",)
        )
        self.policy_primary = c(
            "hivenet_policy_primary_routed",
            "Requests routed by the primary policy step",
            ("model",),
        )
        self.policy_fallback = c(
            "hivenet_policy_fallback_routed",
            "Requests routed by a fallback step",
            ("model", "step"),
        )
        self.policy_exhausted = c(
            "hivenet_policy_exhausted",
            "Requests for which every policy step was exhausted",
            ("model",),
        )
        self.admission_rejections = c(
            "hivenet_admission_rejections",
            "Requests refused before routing, by gate",
            ("reason", "model"),
        )
        self.request_duration = h(
            "hivenet_request_duration_seconds",
            "Duration of public API requests",
            ("endpoint", "status"),
        )
        self.tenant_success = c(
            "hivenet_tenant_requests_success", "Successful requests per tenant", _TENANT
        )
        self.tenant_failed = c(
            "hivenet_tenant_requests_failed", "Failed requests per tenant", _TENANT
        )
        self.tenant_input = c("hivenet_tenant_input_tokens", "Prompt tokens per tenant", _TENANT)
        self.tenant_output = c(
            "hivenet_tenant_output_tokens", "Completion tokens per tenant", _TENANT
        )
        self.tenant_rate_limited = c(
            "hivenet_tenant_rate_limited", "Requests refused by request or token rates", _TENANT
        )
        self.tenant_token_limited = c(
            "hivenet_tenant_token_limited", "Requests refused by the daily token budget", _TENANT
        )
        self.provider_fallback = c(
            "hivenet_policy_provider_fallback",
            "Requests sent to a provider after every local step was exhausted",
            ("model", "provider", "result"),
        )
        self.policy_reload = c("hivenet_policy_reload", "Policy reloads", ("trigger", "result"))
        self.registry.register(
            SeriesCollector(v for v in vars(self).values() if isinstance(v, c | h))
        )
        self._on: dict[type, Callable[[Ticket, Any], None]] = {
            Ended: self._ended,
            Refused: self._refused,
            AnswerHead: self._head,
            Queued: lambda t, e: self.queue_wait.observe((t.model,), e.seconds),
            Attempt: self._attempt,
            Exhausted: lambda t, e: self.policy_exhausted.inc((t.model,)),
        }

    def add(self, collector: Collector) -> None:
        self.registry.register(collector)

    # -- events ---------------------------------------------------------------------------

    def on_event(self, ticket: Ticket, event: Event) -> None:
        handler = self._on.get(type(event))
        if handler is not None:
            handler(ticket, event)

    def _attempt(self, ticket: Ticket, event: Attempt) -> None:
        if event.stale:
            self.connection_resets.inc((event.agent,))

    def _head(self, ticket: Ticket, event: AnswerHead) -> None:
        if event.provider:
            return
        if event.step == 0:
            self.policy_primary.inc((ticket.model,))
        else:
            self.policy_fallback.inc((ticket.model, event.step_name))

    @staticmethod
    def _tenant(ticket: Ticket) -> tuple[str, str, str]:
        principal = ticket.principal
        return (principal.tenant, principal.key_id or "anonymous", ticket.model)

    def _refused(self, ticket: Ticket, event: Refused) -> None:
        if event.reason != "daily":
            self.admission_rejections.inc((event.reason, ticket.model))
        if event.code is ErrorCode.RATE_LIMIT_EXCEEDED:
            self.tenant_rate_limited.inc(self._tenant(ticket))
        elif event.code is ErrorCode.TOKEN_LIMIT_EXCEEDED:
            self.tenant_token_limited.inc(self._tenant(ticket))

    def _ended(self, ticket: Ticket, event: Ended) -> None:
        self.request_duration.observe((ticket.endpoint, str(event.status)), event.seconds)
        if not ticket.dispatched:
            return
        model = ticket.model
        code = event.code
        answered = code is None and event.status < 400 and event.outcome is Outcome.OK
        if code is not None:
            self.failed.inc((model, code.value))
        if ticket.provider:
            result = "success" if answered else "error"
            self.provider_fallback.inc((model, ticket.origin, result))
        elif answered:
            self.routed.inc((model,))
        if ticket.admitted and ticket.principal is not None:
            labels = self._tenant(ticket)
            (self.tenant_success if answered else self.tenant_failed).inc(labels)
            usage = event.usage
            if usage is not None:
                self.tenant_input.inc(labels, usage.input_tokens)
                self.tenant_output.inc(labels, usage.output_tokens)

    def on_agent(self, event: AgentEvent) -> None:
        if event.kind == "disconnected":
            self.disconnections.inc((event.peer_id,))
        elif event.kind == "unhealthy":
            self.agent_failure.inc((event.peer_id,))
        elif event.kind == "backend_down":
            self.backend_failure.inc((event.model,))


# -- what is read at scrape time ---------------------------------------------------------------


class AgentView(Protocol):
    """What the agent collector reads (the registry's records satisfy it)."""

    @property
    def reg(self) -> Registration: ...

    @property
    def eligible(self) -> bool: ...

    active: int
    successes: int
    failures: int
    input_tokens: int
    output_tokens: int
    srtt_ms: float | None
    rttvar_ms: float | None
    engine: EngineSnapshot | None
    hardware: HardwareSnapshot | None
    last_seen_wall: float | None


def _family(kind: Callable[..., Any], name: str, text: str, labels: list[str]) -> Any:
    return kind(name, text, labels=labels)


class AgentCollector(Collector):
    """Every registered agent's series, read from its record when Prometheus scrapes."""

    def __init__(self, agents: Callable[[], Iterable[tuple[AgentView, int]]]) -> None:
        self._agents = agents  # each agent with the streams open on its connection

    def collect(self) -> Iterable[Metric]:
        pm = ["peer_id", "model"]
        g, c = GaugeMetricFamily, CounterMetricFamily
        info = _family(
            g, "hivenet_routing_agent_info", "1 while an agent is registered", list(_AGENT_INFO)
        )
        healthy = _family(g, "hivenet_routing_agent_healthy", "1 healthy, 0 unhealthy", pm)
        seen = _family(
            g,
            "hivenet_routing_agent_last_seen_timestamp",
            "Unix time of the last heartbeat",
            ["peer_id"],
        )
        success = _family(c, "hivenet_agent_requests_success", "Successful requests per agent", pm)
        failed = _family(c, "hivenet_agent_requests_failed", "Failed attempts per agent", pm)
        tokens_in = _family(
            c, "hivenet_agent_input_tokens", "Prompt tokens reported by backends", pm
        )
        tokens_out = _family(
            c, "hivenet_agent_output_tokens", "Completion tokens reported by backends", pm
        )
        load = _family(
            g, "hivenet_agent_capacity_utilization", "Active requests over declared capacity", pm
        )
        srtt = _family(g, "hivenet_agent_srtt_ms", "Smoothed round-trip time (RFC 6298)", pm)
        rttvar = _family(g, "hivenet_agent_rttvar_ms", "Round-trip time variation (RFC 6298)", pm)
        rate = _family(g, "hivenet_agent_success_rate", "Lifetime share of successful forwards", pm)
        streams = _family(
            g, "hivenet_agent_link_streams", "Streams open on the agent's connection", pm
        )
        engine = {
            f: _family(g, f"hivenet_agent_engine_{f}", f"Engine-reported {f}", pm)
            for f in ENGINE_GAUGES
        }
        hardware = {
            f: _family(g, f"hivenet_agent_{f}", text, pm)
            for f, text in (
                ("cpu_usage_percent", "Host CPU use, percent"),
                ("memory_used_percent", "Host memory use, percent"),
                ("gpu_temperature_celsius", "Hottest GPU temperature"),
                ("gpu_utilization_percent", "Busiest GPU compute use, percent"),
            )
        }
        for agent, open_streams in self._agents():
            reg = agent.reg
            ids = [reg.peer_id, reg.model]
            info.add_metric(
                [
                    reg.peer_id,
                    reg.region,
                    reg.engine,
                    reg.model,
                    str(reg.capacity),
                    reg.organization,
                    reg.machine,
                ],
                1,
            )
            healthy.add_metric(ids, 1 if agent.eligible else 0)
            if agent.last_seen_wall is not None:
                seen.add_metric([reg.peer_id], agent.last_seen_wall)
            success.add_metric(ids, agent.successes)
            failed.add_metric(ids, agent.failures)
            tokens_in.add_metric(ids, agent.input_tokens)
            tokens_out.add_metric(ids, agent.output_tokens)
            load.add_metric(ids, agent.active / reg.capacity)
            streams.add_metric(ids, open_streams)
            if agent.srtt_ms is not None and agent.rttvar_ms is not None:
                srtt.add_metric(ids, agent.srtt_ms)
                rttvar.add_metric(ids, agent.rttvar_ms)
            if agent.successes + agent.failures:
                rate.add_metric(ids, agent.successes / (agent.successes + agent.failures))
            _snapshots(agent, ids, engine, hardware)
        yield from (info, healthy, seen, success, failed, tokens_in, tokens_out, load)
        yield from (srtt, rttvar, rate, streams, *engine.values(), *hardware.values())


def _snapshots(
    agent: AgentView, ids: list[str], engine: dict[str, Any], hardware: dict[str, Any]
) -> None:
    if agent.engine is not None:
        for name, family in engine.items():
            value = getattr(agent.engine, name)
            if value is not None:
                family.add_metric(ids, value)
    snapshot = agent.hardware
    if snapshot is not None:
        for name, value in (
            ("cpu_usage_percent", snapshot.cpu_usage_percent),
            ("memory_used_percent", snapshot.memory_used_percent),
            ("gpu_temperature_celsius", snapshot.hottest()),
            ("gpu_utilization_percent", snapshot.busiest()),
        ):
            if value is not None:
                hardware[name].add_metric(ids, value)


class StateCollector(Collector):
    """Occupancy, budgets and queues, read at scrape time."""

    def __init__(
        self,
        occupancy: Callable[[], Iterable[tuple[str, int, int]]],
        limits: Callable[[], Iterable[tuple[str, tuple[int, int]]]],
        waiting: Callable[[], Iterable[tuple[str, int]]],
        pending: Callable[[], tuple[int, int]],
    ) -> None:
        self._occupancy = occupancy
        self._limits = limits
        self._waiting = waiting
        self._pending = pending

    def collect(self) -> Iterable[Metric]:
        g = GaugeMetricFamily
        tokens = g(
            "hivenet_admission_occupancy_tokens", "Token-weighted work in flight", labels=["model"]
        )
        inflight = g(
            "hivenet_admission_inflight_requests",
            "Requests holding an occupancy reservation",
            labels=["model"],
        )
        budget = g(
            "hivenet_admission_budget_tokens",
            "Effective B2 token budget at the last admission",
            labels=["model"],
        )
        backstop = g(
            "hivenet_admission_max_inflight",
            "Effective in-flight backstop at the last admission",
            labels=["model"],
        )
        depth = g("hivenet_queue_depth", "Requests waiting for agent capacity", labels=["model"])
        for model, held, count in self._occupancy():
            tokens.add_metric([model], held)
            inflight.add_metric([model], count)
        for model, (limit, most) in self._limits():
            budget.add_metric([model], limit)
            backstop.add_metric([model], most)
        for model, waiting in self._waiting():
            depth.add_metric([model], waiting)
        queued, forwarding = self._pending()
        global_queue = g(
            "hivenet_router_pending_requests", "Requests waiting for a forwarding slot"
        )
        global_queue.add_metric([], queued)
        forwards = g("hivenet_router_active_forwards", "Requests being forwarded to agents")
        forwards.add_metric([], forwarding)
        yield from (tokens, inflight, budget, backstop, depth, global_queue, forwards)
