"""What the metrics read when Prometheus scrapes, rather than count as requests go by.

Agents and their statistics, engine and hardware snapshots, occupancy, queues, requests in
flight and tenants' daily totals are states held by other objects; reading them at scrape
time costs the request path nothing and a series can never go stale: it disappears with
its agent. Label sets are the reference's (docs/observability.md lists where they differ).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from hivenet_router.domain.agent import (
    EngineHistograms,
    EngineSnapshot,
    HardwareSnapshot,
    Histogram,
    Registration,
)

# Label sets, as the reference names them.
ROUTING = ("peer_id", "region", "engine", "model", "capacity", "organization", "machine")
AGENT = ("peer_id", "model", "engine", "organization", "machine")
HOST = ("peer_id", "region", "model", "engine", "organization", "machine")
GPU = ("peer_id", "region", "model", "engine", "gpu_index", "gpu_id", "organization", "machine")

ENGINE_GAUGES = (
    "kv_cache_utilization",
    "running_requests",
    "waiting_requests",
    "preemptions_total",
    "avg_ttft_seconds",
    "p90_ttft_seconds",
    "avg_itl_seconds",
    "p90_itl_seconds",
    "predicted_tps",
    "prompt_tps",
)
_ENGINE_HISTOGRAMS = (
    ("ttft_seconds", "Engine-reported time to first token"),
    ("itl_seconds", "Engine-reported time between output tokens"),
    ("request_prompt_tokens", "Engine-reported prompt tokens per request"),
    ("request_generation_tokens", "Engine-reported generated tokens per request"),
)
_HOST_GAUGES = (
    ("cpu_usage_percent", "Host CPU use, percent"),
    ("memory_used_percent", "Host memory use, percent"),
    ("memory_available_bytes", "Host memory available, bytes"),
    ("memory_total_bytes", "Host memory, bytes"),
)
_GPU_GAUGES = (
    ("gpu_utilization_percent", "util_percent", "GPU compute use, percent"),
    ("gpu_temperature_celsius", "temperature_c", "GPU temperature"),
    ("gpu_vram_used_bytes", "vram_used_bytes", "GPU memory in use, bytes"),
    ("gpu_vram_free_bytes", "vram_free_bytes", "GPU memory free, bytes"),
    ("gpu_vram_total_bytes", "vram_total_bytes", "GPU memory, bytes"),
    ("gpu_power_watts", "power_watts", "GPU power draw, watts"),
)


class AgentView(Protocol):
    """What the agent collector reads (the registry's records satisfy it)."""

    @property
    def reg(self) -> Registration: ...

    @property
    def eligible(self) -> bool: ...

    @property
    def active(self) -> int: ...

    successes: int
    failures: int
    rejected: int
    input_tokens: int
    output_tokens: int
    disconnects: int
    health_failures: int
    backend_failures: int
    srtt_ms: float | None
    rttvar_ms: float | None
    engine: EngineSnapshot | None
    hardware: HardwareSnapshot | None
    histograms: EngineHistograms | None
    last_seen_wall: float | None


def _gauge(name: str, text: str, labels: tuple[str, ...]) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, text, labels=list(labels))


def _counter(name: str, text: str, labels: tuple[str, ...]) -> CounterMetricFamily:
    return CounterMetricFamily(name, text, labels=list(labels))


# Per-agent numbers, each read from the record: (name, help, kind, value).
_PER_AGENT: tuple[tuple[str, str, Callable[..., Any], Callable[[AgentView], float | None]], ...] = (
    (
        "hivenet_agent_requests_success",
        "Successful requests per agent",
        _counter,
        lambda a: a.successes,
    ),
    ("hivenet_agent_requests_failed", "Failed attempts per agent", _counter, lambda a: a.failures),
    (
        "hivenet_agent_rejected_requests",
        "Times the agent was picked while at its capacity",
        _counter,
        lambda a: a.rejected,
    ),
    (
        "hivenet_agent_input_tokens",
        "Prompt tokens reported by backends",
        _counter,
        lambda a: a.input_tokens,
    ),
    (
        "hivenet_agent_output_tokens",
        "Completion tokens reported by backends",
        _counter,
        lambda a: a.output_tokens,
    ),
    (
        "hivenet_agent_disconnections",
        "Agent connections lost or removed",
        _counter,
        lambda a: a.disconnects,
    ),
    (
        "hivenet_agent_failure",
        "Times the agent was marked unhealthy after missed heartbeats",
        _counter,
        lambda a: a.health_failures,
    ),
    (
        "hivenet_model_backend_failure",
        "Times the agent reported its backend unhealthy",
        _counter,
        lambda a: a.backend_failures,
    ),
    (
        "hivenet_agent_capacity_utilization",
        "Active requests over declared capacity",
        _gauge,
        lambda a: a.active / a.reg.capacity,
    ),
    (
        "hivenet_agent_srtt_ms",
        "Smoothed round-trip time (RFC 6298)",
        _gauge,
        lambda a: a.srtt_ms if a.rttvar_ms is not None else None,
    ),
    (
        "hivenet_agent_rttvar_ms",
        "Round-trip time variation (RFC 6298)",
        _gauge,
        lambda a: a.rttvar_ms if a.srtt_ms is not None else None,
    ),
    (
        "hivenet_agent_success_rate",
        "Lifetime share of successful forwards",
        _gauge,
        lambda a: a.successes / (a.successes + a.failures) if a.successes + a.failures else None,
    ),
)


class AgentCollector(Collector):
    """Every registered agent's series, read from its record when Prometheus scrapes."""

    def __init__(self, agents: Callable[[], Iterable[tuple[AgentView, int]]]) -> None:
        self._agents = agents  # each agent with the streams open on its connection

    def collect(self) -> Iterable[Metric]:
        info = _gauge("hivenet_routing_agent_info", "1 while an agent is registered", ROUTING)
        healthy = _gauge("hivenet_routing_agent_healthy", "1 eligible, 0 not", ROUTING)
        seen = _gauge(
            "hivenet_routing_agent_last_seen_timestamp",
            "Unix time of the last heartbeat, in milliseconds",
            ROUTING,
        )
        per_agent = [(kind(name, text, AGENT), value) for name, text, kind, value in _PER_AGENT]
        streams = _gauge(
            "hivenet_agent_link_streams", "Streams open on the agent's connection", AGENT
        )
        engine = {
            f: _gauge(f"hivenet_agent_engine_{f}", f"Engine-reported {f}", AGENT)
            for f in ENGINE_GAUGES
        }
        host = {f: _gauge(f"hivenet_agent_{f}", text, HOST) for f, text in _HOST_GAUGES}
        histograms = {
            f: HistogramMetricFamily(f"hivenet_agent_engine_{f}", text, labels=list(AGENT))
            for f, text in _ENGINE_HISTOGRAMS
        }
        finished = _counter(
            "hivenet_agent_engine_request_success",
            "Requests the engine finished, by finish reason",
            (*AGENT, "finished_reason"),
        )
        gpus = {f: _gauge(f"hivenet_agent_{name}", text, GPU) for name, f, text in _GPU_GAUGES}
        for agent, open_streams in self._agents():
            reg = agent.reg
            routing = [
                reg.peer_id,
                reg.region,
                reg.engine,
                reg.model,
                str(reg.capacity),
                reg.organization,
                reg.machine,
            ]
            ids = [reg.peer_id, reg.model, reg.engine, reg.organization, reg.machine]
            info.add_metric(routing, 1)
            healthy.add_metric(routing, 1 if agent.eligible else 0)
            if agent.last_seen_wall is not None:
                seen.add_metric(routing, agent.last_seen_wall * 1000)
            for family, value in per_agent:
                number = value(agent)
                if number is not None:
                    family.add_metric(ids, number)
            streams.add_metric(ids, open_streams)
            _engine(agent.engine, ids, engine)
            _histograms(agent.histograms, ids, histograms, finished)
            _hardware(agent, host, gpus)
        yield from (info, healthy, seen, *(family for family, _ in per_agent), streams)
        yield from (*engine.values(), *histograms.values(), finished)
        yield from (*host.values(), *gpus.values())


def _engine(snapshot: EngineSnapshot | None, ids: list[str], families: dict[str, Any]) -> None:
    if snapshot is None:
        return
    for name, family in families.items():
        value = getattr(snapshot, name, None)
        if value is not None:
            family.add_metric(ids, value)


def _histograms(
    found: EngineHistograms | None,
    ids: list[str],
    families: dict[str, HistogramMetricFamily],
    finished: CounterMetricFamily,
) -> None:
    """The engine's own histograms, as the agent last forwarded them (cumulative, so they
    pass through unchanged: Prometheus computes rates and quantiles from them)."""
    if found is None:
        return
    for name, family in families.items():
        histogram: Histogram | None = getattr(found, name)
        if histogram is not None and len(histogram.bounds) == len(histogram.counts):
            buckets = [
                (repr(b), c) for b, c in zip(histogram.bounds, histogram.counts, strict=True)
            ]
            buckets.append(("+Inf", histogram.count))
            family.add_metric(ids, buckets, histogram.sum)
    for reason, count in found.finished.items():
        finished.add_metric([*ids, reason], count)


def _hardware(agent: AgentView, host: dict[str, Any], gpus: dict[str, Any]) -> None:
    snapshot = agent.hardware
    if snapshot is None:
        return
    reg = agent.reg
    where = [reg.peer_id, reg.region, reg.model, reg.engine]
    owner = [reg.organization, reg.machine]
    for name, family in host.items():
        value = getattr(snapshot, name)
        if value is not None:
            family.add_metric(where + owner, value)
    for position, gpu in enumerate(snapshot.gpus):
        index = str(gpu.index if gpu.index is not None else position)
        labels = [*where, index, f"{reg.peer_id}_{index}", *owner]
        for name, family in gpus.items():
            value = getattr(gpu, name)
            if value is not None:
                family.add_metric(labels, value)


class StateCollector(Collector):
    """Occupancy, budgets and queues, read at scrape time."""

    def __init__(
        self,
        occupancy: Callable[[], Iterable[tuple[str, int, int]]],
        limits: Callable[[], Iterable[tuple[str, tuple[int, int]]]],
        waiting: Callable[[], Iterable[tuple[str, int]]],
        pending: Callable[[], tuple[int, int, int]],
    ) -> None:
        self._occupancy = occupancy
        self._limits = limits
        self._waiting = waiting
        self._pending = pending

    def collect(self) -> Iterable[Metric]:
        model = ("model",)
        tokens = _gauge(
            "hivenet_admission_occupancy_tokens", "Token-weighted work in flight", model
        )
        inflight = _gauge(
            "hivenet_admission_inflight_requests",
            "Requests holding an occupancy reservation",
            model,
        )
        budget = _gauge(
            "hivenet_admission_budget_tokens",
            "Effective B2 token budget at the last admission",
            model,
        )
        backstop = _gauge(
            "hivenet_admission_max_inflight",
            "Effective in-flight backstop at the last admission",
            model,
        )
        depth = _gauge("hivenet_queue_depth", "Requests waiting for agent capacity", model)
        for name, held, count in self._occupancy():
            tokens.add_metric([name], held)
            inflight.add_metric([name], count)
        for name, (limit, most) in self._limits():
            budget.add_metric([name], limit)
            backstop.add_metric([name], most)
        for name, waiting in self._waiting():
            depth.add_metric([name], waiting)
        queued, forwarding, allowed = self._pending()
        global_queue = _gauge(
            "hivenet_router_pending_requests", "Requests waiting for a forwarding slot", ()
        )
        global_queue.add_metric([], queued)
        forwards = _gauge(
            "hivenet_router_active_forwards", "Requests being forwarded to agents", ()
        )
        forwards.add_metric([], forwarding)
        forward_limit = _gauge(
            "hivenet_router_forwarding_limit",
            "Requests this router may forward at once (--max-concurrent, or what the fleet runs)",
            (),
        )
        forward_limit.add_metric([], allowed)
        yield from (
            tokens,
            inflight,
            budget,
            backstop,
            depth,
            global_queue,
            forwards,
            forward_limit,
        )


class RequestsCollector(Collector):
    """Requests in flight on the public port, by method and route, and each tenant's
    tokens counted today (what the daily budgets hold; tenants without one are absent)."""

    def __init__(
        self,
        inflight: Callable[[], Iterable[tuple[str, str]]],
        used_today: Callable[[], Iterable[tuple[str, int]]],
    ) -> None:
        self._inflight = inflight
        self._used_today = used_today

    def collect(self) -> Iterable[Metric]:
        active = _gauge("http_server_active_requests", "Requests being served", ("method", "route"))
        counts: dict[tuple[str, str], int] = {}
        for key in self._inflight():
            counts[key] = counts.get(key, 0) + 1
        for (method, route), count in counts.items():
            active.add_metric([method, route], count)
        used = _gauge(
            "hivenet_tenant_tokens_used_today",
            "Tokens charged to the tenant's daily budgets today (UTC)",
            ("tenant_id",),
        )
        totals: dict[str, int] = {}
        for budget, tokens in self._used_today():
            tenant = budget.partition("\x00")[0]  # per-model budgets are kept as tenant\0model
            totals[tenant] = totals.get(tenant, 0) + tokens
        for tenant, tokens in totals.items():
            used.add_metric([tenant], tokens)
        yield from (active, used)
