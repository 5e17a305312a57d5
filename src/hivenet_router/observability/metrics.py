"""The router's Prometheus metrics, in the Go router's names, as an observer.

Counters and histograms of what happens to requests are fed by events (nothing on the
request path calls them directly). What is a state rather than an event (agents and their
statistics, occupancy, queues) is read at scrape time from the objects that hold it, so the
request path pays nothing for it and a series can never go stale.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram
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
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self._routing_metrics()
        self._tenant_metrics()

    def _counter(self, name: str, text: str, labels: tuple[str, ...]) -> Counter:
        return Counter(name, text, labels, registry=self.registry)

    def _routing_metrics(self) -> None:
        counter, r = self._counter, self.registry
        self.routed = counter(
            "hivenet_routing_requests_routed_total", "Requests answered by an agent", ("model",)
        )
        self.failed = counter(
            "hivenet_routing_requests_failed_total",
            "Requests that ended in a router error",
            ("model", "code"),
        )
        self.disconnections = counter(
            "hivenet_agent_disconnections_total", "Agent connections lost or removed", ("peer_id",)
        )
        self.agent_failure = counter(
            "hivenet_agent_failure_total",
            "Agents marked unhealthy after missed heartbeats",
            ("peer_id",),
        )
        self.backend_failure = counter(
            "hivenet_model_backend_failure_total",
            "Agents that reported their backend unhealthy",
            ("model",),
        )
        self.connection_resets = counter(
            "hivenet_agent_connection_resets_total",
            "Forwards retried because a connection was stale",
            ("peer_id",),
        )
        self.queue_wait = Histogram(
            "hivenet_queue_wait_seconds",
            "Time spent waiting for agent capacity",
            ("model",),
            registry=r,
        )
        self.policy_primary = counter(
            "hivenet_policy_primary_routed_total",
            "Requests routed by the primary policy step",
            ("model",),
        )
        self.policy_fallback = counter(
            "hivenet_policy_fallback_routed_total",
            "Requests routed by a fallback step",
            ("model", "step"),
        )
        self.policy_exhausted = counter(
            "hivenet_policy_exhausted_total",
            "Requests for which every policy step was exhausted",
            ("model",),
        )
        self.admission_rejections = counter(
            "hivenet_admission_rejections_total",
            "Requests refused before routing, by gate",
            ("reason", "model"),
        )
        self.request_duration = Histogram(
            "hivenet_request_duration_seconds",
            "Duration of public API requests",
            ("endpoint", "status"),
            registry=r,
        )

    def _tenant_metrics(self) -> None:
        counter = self._counter
        self.tenant_success = counter(
            "hivenet_tenant_requests_success_total", "Successful requests per tenant", _TENANT
        )
        self.tenant_failed = counter(
            "hivenet_tenant_requests_failed_total", "Failed requests per tenant", _TENANT
        )
        self.tenant_input = counter(
            "hivenet_tenant_input_tokens_total", "Prompt tokens per tenant", _TENANT
        )
        self.tenant_output = counter(
            "hivenet_tenant_output_tokens_total", "Completion tokens per tenant", _TENANT
        )
        self.tenant_rate_limited = counter(
            "hivenet_tenant_rate_limited_total",
            "Requests refused by request or token rates",
            _TENANT,
        )
        self.tenant_token_limited = counter(
            "hivenet_tenant_token_limited_total",
            "Requests refused by the daily token budget",
            _TENANT,
        )
        self.provider_fallback = counter(
            "hivenet_policy_provider_fallback_total",
            "Requests sent to a provider after every local step was exhausted",
            ("model", "provider", "result"),
        )
        self.policy_reload = counter(
            "hivenet_policy_reload_total", "Policy reloads", ("trigger", "result")
        )

    def _child(self, metric: Counter | Histogram, *labels: str) -> Any:
        """A labelled series, looked up once: the request path pays a dict lookup."""
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def add(self, collector: Collector) -> None:
        self.registry.register(collector)

    # -- events ---------------------------------------------------------------------------

    def on_event(self, ticket: Ticket, event: Event) -> None:
        if isinstance(event, Ended):
            self._ended(ticket, event)
        elif isinstance(event, Refused):
            self._refused(ticket, event)
        elif isinstance(event, AnswerHead):
            if event.provider:
                return
            if event.step == 0:
                self._child(self.policy_primary, ticket.model).inc()
            else:
                self._child(self.policy_fallback, ticket.model, event.step_name).inc()
        elif isinstance(event, Queued):
            self._child(self.queue_wait, ticket.model).observe(event.seconds)
        elif isinstance(event, Attempt):
            if event.stale:
                self._child(self.connection_resets, event.agent).inc()
        elif isinstance(event, Exhausted):
            self._child(self.policy_exhausted, ticket.model).inc()

    def _tenant(self, ticket: Ticket) -> tuple[str, str, str]:
        principal = ticket.principal
        return (principal.tenant, principal.key_id or "anonymous", ticket.model)

    def _refused(self, ticket: Ticket, event: Refused) -> None:
        if event.reason != "daily":
            self._child(self.admission_rejections, event.reason, ticket.model).inc()
        if event.code is ErrorCode.RATE_LIMIT_EXCEEDED:
            self._child(self.tenant_rate_limited, *self._tenant(ticket)).inc()
        elif event.code is ErrorCode.TOKEN_LIMIT_EXCEEDED:
            self._child(self.tenant_token_limited, *self._tenant(ticket)).inc()

    def _ended(self, ticket: Ticket, event: Ended) -> None:
        self._child(self.request_duration, ticket.endpoint, str(event.status)).observe(
            event.seconds
        )
        if not ticket.dispatched:
            return
        model = ticket.model
        code = event.code
        answered = code is None and event.status < 400 and event.outcome is Outcome.OK
        if code is not None:
            self._child(self.failed, model, code.value).inc()
        if ticket.provider:
            result = "success" if answered else "error"
            self._child(self.provider_fallback, model, ticket.origin, result).inc()
        elif answered:
            self._child(self.routed, model).inc()
        if ticket.admitted and ticket.principal is not None:
            labels = self._tenant(ticket)
            self._child(self.tenant_success if answered else self.tenant_failed, *labels).inc()
            usage = event.usage
            if usage is not None:
                self._child(self.tenant_input, *labels).inc(usage.input_tokens)
                self._child(self.tenant_output, *labels).inc(usage.output_tokens)

    def on_agent(self, event: AgentEvent) -> None:
        if event.kind == "disconnected":
            self.disconnections.labels(event.peer_id).inc()
        elif event.kind == "unhealthy":
            self.agent_failure.labels(event.peer_id).inc()
        elif event.kind == "backend_down":
            self.backend_failure.labels(event.model).inc()


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
