"""The router's Prometheus metrics, in the Go router's names, on a registry of their own."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

_AGENT_INFO = ("peer_id", "region", "engine", "model", "capacity", "organization", "machine")


@dataclass(frozen=True, slots=True)
class AgentMeters:
    """One agent's labelled series, looked up once at registration instead of per request."""

    success: Any
    failed: Any
    utilization: Any
    input_tokens: Any
    output_tokens: Any
    srtt: Any
    rttvar: Any
    success_rate: Any


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.agent_info = Gauge(
            "hivenet_routing_agent_info", "1 while an agent is registered", _AGENT_INFO, registry=r
        )
        self.agent_healthy = Gauge(
            "hivenet_routing_agent_healthy",
            "1 healthy, 0 unhealthy",
            ("peer_id", "model"),
            registry=r,
        )
        self.agent_last_seen = Gauge(
            "hivenet_routing_agent_last_seen_timestamp",
            "Unix time of the last heartbeat",
            ("peer_id",),
            registry=r,
        )
        self.routed = Counter(
            "hivenet_routing_requests_routed_total",
            "Requests answered by an agent",
            ("model",),
            registry=r,
        )
        self.failed = Counter(
            "hivenet_routing_requests_failed_total",
            "Requests that ended in a router error",
            ("model", "code"),
            registry=r,
        )
        self.agent_success = Counter(
            "hivenet_agent_requests_success_total",
            "Successful requests per agent",
            ("peer_id", "model"),
            registry=r,
        )
        self.agent_failed = Counter(
            "hivenet_agent_requests_failed_total",
            "Failed attempts per agent",
            ("peer_id", "model"),
            registry=r,
        )
        self.input_tokens = Counter(
            "hivenet_agent_input_tokens_total",
            "Prompt tokens reported by backends",
            ("peer_id", "model"),
            registry=r,
        )
        self.output_tokens = Counter(
            "hivenet_agent_output_tokens_total",
            "Completion tokens reported by backends",
            ("peer_id", "model"),
            registry=r,
        )
        self.capacity_utilization = Gauge(
            "hivenet_agent_capacity_utilization",
            "Active requests over declared capacity",
            ("peer_id", "model"),
            registry=r,
        )
        self.srtt = Gauge(
            "hivenet_agent_srtt_ms",
            "Smoothed round-trip time (RFC 6298)",
            ("peer_id", "model"),
            registry=r,
        )
        self.rttvar = Gauge(
            "hivenet_agent_rttvar_ms",
            "Round-trip time variation (RFC 6298)",
            ("peer_id", "model"),
            registry=r,
        )
        self.success_rate = Gauge(
            "hivenet_agent_success_rate",
            "Lifetime share of successful forwards",
            ("peer_id", "model"),
            registry=r,
        )
        self.disconnections = Counter(
            "hivenet_agent_disconnections_total",
            "Agent connections lost or removed",
            ("peer_id",),
            registry=r,
        )
        self.agent_failure = Counter(
            "hivenet_agent_failure_total",
            "Agents marked unhealthy after missed heartbeats",
            ("peer_id",),
            registry=r,
        )
        self.backend_failure = Counter(
            "hivenet_model_backend_failure_total",
            "Agents that reported their backend unhealthy",
            ("model",),
            registry=r,
        )
        self.connection_resets = Counter(
            "hivenet_agent_connection_resets_total",
            "Forwards retried because a connection was stale",
            ("peer_id",),
            registry=r,
        )
        self.queue_depth = Gauge(
            "hivenet_queue_depth", "Requests waiting for agent capacity", ("model",), registry=r
        )
        self.queue_wait = Histogram(
            "hivenet_queue_wait_seconds",
            "Time spent waiting for agent capacity",
            ("model",),
            registry=r,
        )
        self.policy_primary = Counter(
            "hivenet_policy_primary_routed_total",
            "Requests routed by the primary policy step",
            ("model",),
            registry=r,
        )
        self.policy_fallback = Counter(
            "hivenet_policy_fallback_routed_total",
            "Requests routed by a fallback step",
            ("model", "step"),
            registry=r,
        )
        self.policy_exhausted = Counter(
            "hivenet_policy_exhausted_total",
            "Requests for which every policy step was exhausted",
            ("model",),
            registry=r,
        )
        self.admission_rejections = Counter(
            "hivenet_admission_rejections_total",
            "Requests refused before routing, by gate",
            ("reason", "model"),
            registry=r,
        )
        tenant = ("tenant_id", "key_id", "model")
        self.tenant_success = Counter(
            "hivenet_tenant_requests_success_total",
            "Successful requests per tenant",
            tenant,
            registry=r,
        )
        self.tenant_failed = Counter(
            "hivenet_tenant_requests_failed_total", "Failed requests per tenant", tenant, registry=r
        )
        self.tenant_input = Counter(
            "hivenet_tenant_input_tokens_total", "Prompt tokens per tenant", tenant, registry=r
        )
        self.tenant_output = Counter(
            "hivenet_tenant_output_tokens_total", "Completion tokens per tenant", tenant, registry=r
        )
        self.tenant_rate_limited = Counter(
            "hivenet_tenant_rate_limited_total",
            "Requests refused by request or token rates",
            tenant,
            registry=r,
        )
        self.tenant_token_limited = Counter(
            "hivenet_tenant_token_limited_total",
            "Requests refused by the daily token budget",
            tenant,
            registry=r,
        )
        self.provider_fallback = Counter(
            "hivenet_policy_provider_fallback_total",
            "Requests sent to a provider after every local step was exhausted",
            ("model", "provider", "result"),
            registry=r,
        )
        self.policy_reload = Counter(
            "hivenet_policy_reload_total",
            "Policy reloads",
            ("trigger", "result"),
            registry=r,
        )
        self.global_queue = Gauge(
            "hivenet_router_pending_requests", "Requests waiting for a forwarding slot", registry=r
        )
        self.forwards = Gauge(
            "hivenet_router_active_forwards", "Requests being forwarded to agents", registry=r
        )
        self.request_duration = Histogram(
            "hivenet_request_duration_seconds",
            "Duration of public API requests",
            ("endpoint", "status"),
            registry=r,
        )
        self.hardware = {
            name: Gauge(f"hivenet_agent_{name}", help_text, ("peer_id", "model"), registry=r)
            for name, help_text in (
                ("cpu_usage_percent", "Host CPU use, percent"),
                ("memory_used_percent", "Host memory use, percent"),
                ("gpu_temperature_celsius", "Hottest GPU temperature"),
                ("gpu_utilization_percent", "Busiest GPU compute use, percent"),
            )
        }
        self.engine = {
            field: Gauge(
                f"hivenet_agent_engine_{field}",
                f"Engine-reported {field}",
                ("peer_id", "model"),
                registry=r,
            )
            for field in (
                "kv_cache_utilization",
                "running_requests",
                "waiting_requests",
                "preemptions_total",
                "avg_ttft_seconds",
                "p90_ttft_seconds",
                "avg_itl_seconds",
                "p90_itl_seconds",
            )
        }

    def agent_meters(self, peer_id: str, model: str) -> AgentMeters:
        return AgentMeters(
            success=self.agent_success.labels(peer_id, model),
            failed=self.agent_failed.labels(peer_id, model),
            utilization=self.capacity_utilization.labels(peer_id, model),
            input_tokens=self.input_tokens.labels(peer_id, model),
            output_tokens=self.output_tokens.labels(peer_id, model),
            srtt=self.srtt.labels(peer_id, model),
            rttvar=self.rttvar.labels(peer_id, model),
            success_rate=self.success_rate.labels(peer_id, model),
        )


class AdmissionCollector(Collector):
    """Occupancy gauges read at scrape time, so the request path pays nothing for them."""

    def __init__(self, admission: Any) -> None:
        self._admission = admission

    def collect(self) -> Iterable[Metric]:
        tokens = GaugeMetricFamily(
            "hivenet_admission_occupancy_tokens", "Token-weighted work in flight", labels=["model"]
        )
        inflight = GaugeMetricFamily(
            "hivenet_admission_inflight_requests",
            "Requests holding an occupancy reservation",
            labels=["model"],
        )
        budget = GaugeMetricFamily(
            "hivenet_admission_budget_tokens",
            "Effective B2 token budget at the last admission",
            labels=["model"],
        )
        backstop = GaugeMetricFamily(
            "hivenet_admission_max_inflight",
            "Effective in-flight backstop at the last admission",
            labels=["model"],
        )
        for model, pool in list(self._admission.pools.items()):
            tokens.add_metric([model], pool.tokens)
            inflight.add_metric([model], pool.inflight)
        for model, (limit, most) in list(self._admission.limits.items()):
            budget.add_metric([model], limit)
            backstop.add_metric([model], most)
        yield from (tokens, inflight, budget, backstop)


class LinkCollector(Collector):
    """Streams open on each agent's connection, read at scrape time: after every request has
    ended it must be zero, or something was left behind."""

    def __init__(self, source: Callable[[], Iterable[tuple[str, str, int]]]) -> None:
        self._source = source

    def collect(self) -> Iterable[Metric]:
        streams = GaugeMetricFamily(
            "hivenet_agent_link_streams",
            "Streams open on the agent's connection",
            labels=["peer_id", "model"],
        )
        for peer_id, model, count in self._source():
            streams.add_metric([peer_id, model], count)
        yield streams
