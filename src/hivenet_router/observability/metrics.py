"""The router's Prometheus metrics, in the Go router's names and label sets, as an observer.

Counters and histograms of what happens to requests are fed by events (nothing on the
request path calls them directly). What is a state rather than an event (agents and their
statistics, occupancy, queues, requests in flight) is read at scrape time by the
collectors in collectors.py, so the request path pays nothing for it.

Every label value is chosen by the router, an operator or an authenticated agent, never by
a client: models are labelled only once the router knows them (a made-up model name is
refused before anything counts it), methods are one of a fixed few, routes are the route
table's templates.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

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

_TENANT = ("tenant_id", "key_id", "deployment_id", "model")
UNSET = "unset"  # deployment_id before an agent was chosen
# Waits and durations: 10 ms doubling to about 41 s, as the Go router buckets them.
WAIT_BUCKETS = tuple(0.01 * 2**n for n in range(13))


class MetricsObserver:
    """Request and agent events counted into Prometheus series.

    `replicas(model)` says how many healthy agents serve a model (a per-model quota's
    effective ceiling scales with it)."""

    def __init__(self, replicas: Callable[[str], int] = lambda model: 0) -> None:
        self.registry = CollectorRegistry()
        self._replicas = replicas
        c, h = CounterSeries, HistogramSeries
        where = ("region", "engine", "model", "tenant_id")
        self.routed = c("hivenet_routing_requests_routed", "Requests answered by an agent", where)
        self.failed = c(
            "hivenet_routing_requests_failed",
            "Dispatched requests that ended in an error",
            (*where, "code"),
        )
        self.connection_resets = c(
            "hivenet_agent_connection_resets",
            "Forwards retried because an agent's connection was found gone",
            ("model", "reason"),
        )
        self.queue_wait = h(
            "hivenet_queue_wait_seconds",
            "Time spent waiting for agent capacity",
            ("model",),
            WAIT_BUCKETS,
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
        self.provider_fallback = c(
            "hivenet_policy_provider_fallback",
            "Requests a cloud provider answered after every local step was exhausted",
            ("model", "provider"),
        )
        self.admission_rejections = c(
            "hivenet_admission_rejections",
            "Requests refused before routing, by gate",
            ("reason", "model"),
        )
        self.http_server = h(
            "http_server_request_duration_seconds",
            "Duration of requests on the public port",
            ("method", "route", "status_code"),
        )
        self.http_client = h(
            "http_client_request_duration_seconds",
            "Time to the answer's head of calls to cloud providers",
            ("provider", "status_code"),
            WAIT_BUCKETS,
        )
        self.request_duration = h(
            "hivenet_request_duration_seconds",
            "Duration of dispatched inference requests",
            ("tenant_id", "peer_id", "model", "status_code"),
            WAIT_BUCKETS,
        )
        self._tenant_series()
        self.policy_reload = c("hivenet_policy_reload", "Policy reloads", ("trigger", "result"))
        self.quota_errors = c(
            "hivenet_quota_backend_errors", "Failures to save or restore quota state", ()
        )
        self.quota_errors.inc((), 0)  # present from the start, so the first error is a rise
        self.tenants = TenantGauges()
        self.registry.register(
            SeriesCollector(v for v in vars(self).values() if isinstance(v, c | h))
        )
        self.registry.register(self.tenants)
        ProcessCollector(registry=self.registry)
        self._on: dict[type, Callable[[Ticket, Any], None]] = {
            Ended: self._ended,
            Refused: self._refused,
            AnswerHead: self._head,
            Queued: lambda t, e: self.queue_wait.observe((t.model,), e.seconds),
            Attempt: self._attempt,
            Exhausted: lambda t, e: self.policy_exhausted.inc((t.model,)),
        }
        self.observes = frozenset(self._on)  # the fan-out calls on_event for these alone

    def _tenant_series(self) -> None:
        c, h = CounterSeries, HistogramSeries
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
        self.tenant_duration = h(
            "hivenet_tenant_request_duration_seconds",
            "Duration of each tenant's inference requests",
            _TENANT,
            WAIT_BUCKETS,
        )
        self.tenant_rate_limited = c(
            "hivenet_tenant_rate_limited",
            "Requests refused by the requests-per-minute quota",
            ("tenant_id", "key_id"),
        )
        self.tenant_token_limited = c(
            "hivenet_tenant_token_limited",
            "Requests refused by the daily token budget",
            ("tenant_id", "key_id", "deployment_id", "phase"),
        )

    def add(self, collector: Collector) -> None:
        self.registry.register(collector)

    def provider_call(self, provider: str, status: int, seconds: float) -> None:
        self.http_client.observe((provider, str(status)), seconds)

    # -- events ---------------------------------------------------------------------------

    def on_event(self, ticket: Ticket, event: Event) -> None:
        handler = self._on.get(type(event))
        if handler is not None:
            handler(ticket, event)

    def on_agent(self, event: AgentEvent) -> None:
        return None  # agents' own counters live on their records (collectors.py)

    def _attempt(self, ticket: Ticket, event: Attempt) -> None:
        if event.stale:
            self.connection_resets.inc((ticket.model, "stale_connection"))

    def _head(self, ticket: Ticket, event: AnswerHead) -> None:
        if event.provider:
            return
        if event.step == 0:
            self.policy_primary.inc((ticket.model,))
        else:
            self.policy_fallback.inc((ticket.model, event.step_name))

    @staticmethod
    def _key(ticket: Ticket) -> tuple[str, str]:
        principal = ticket.principal
        return principal.tenant, principal.key_id or "anonymous"

    def _refused(self, ticket: Ticket, event: Refused) -> None:
        if event.reason != "daily":
            self.admission_rejections.inc((event.reason, ticket.model))
        if ticket.principal is None:
            return
        if event.reason == "b4_rpm":
            self.tenant_rate_limited.inc(self._key(ticket))
        elif event.code is ErrorCode.TOKEN_LIMIT_EXCEEDED:
            self.tenant_token_limited.inc((*self._key(ticket), UNSET, "input"))

    def _ended(self, ticket: Ticket, event: Ended) -> None:
        status = str(event.status)
        self.http_server.observe((ticket.method, ticket.endpoint, status), event.seconds)
        if ticket.job is None or ticket.principal is None:
            return  # not an inference request for a model the router knows
        model = ticket.model
        answered = event.code is None and event.status < 400 and event.outcome is Outcome.OK
        tenant, key = self._key(ticket)
        agent = ticket.agent
        deployment = (agent.deployment_id or UNSET) if agent is not None else UNSET
        labels = (tenant, key, deployment, model)
        (self.tenant_success if answered else self.tenant_failed).inc(labels)
        self.tenants.seen(ticket, self._replicas)
        if not ticket.dispatched:
            return
        self.tenant_duration.observe(labels, event.seconds)
        self.request_duration.observe((tenant, ticket.origin, model, status), event.seconds)
        usage = event.usage
        if usage is not None and ticket.admitted:
            self.tenant_input.inc(labels, usage.input_tokens)
            self.tenant_output.inc(labels, usage.output_tokens)
        where = (agent.region, agent.engine) if agent is not None else ("", "")
        if event.code is not None:
            self.failed.inc((*where, model, tenant, event.code.value))
        if ticket.provider:
            if answered:
                self.provider_fallback.inc((model, ticket.origin))
        elif answered:
            self.routed.inc((*where, model, tenant))


class TenantGauges(Collector):
    """Each tenant's quota ceilings and the time of its last request, as its requests show
    them (a tenant appears with its first request)."""

    def __init__(self) -> None:
        self.rpm: dict[str, int] = {}
        self.tpd: dict[str, int] = {}
        self.model_rpm: dict[tuple[str, str], int] = {}
        self.model_tpd: dict[tuple[str, str], int] = {}
        self.last: dict[tuple[str, str, str], float] = {}

    def seen(self, ticket: Ticket, replicas: Callable[[str], int]) -> None:
        """Note the request's tenant; `replicas(model)` is asked only for a per-model
        quota, whose ceiling scales with the healthy agents (a registry walk)."""
        principal = ticket.principal
        tenant, quota, model = principal.tenant, principal.quota, ticket.model
        agent = ticket.agent
        deployment = (agent.deployment_id or UNSET) if agent is not None else UNSET
        self.last[(tenant, principal.key_id or "anonymous", deployment)] = time.time()
        if quota.per_model is None:
            if quota.requests_per_minute:
                self.rpm[tenant] = quota.requests_per_minute
            if quota.tokens_per_day:
                self.tpd[tenant] = quota.tokens_per_day
            return
        entry = quota.per_model.get(model)
        if entry is not None:
            self.model_rpm[(tenant, model)] = entry.rpm_per_replica * replicas(model)
            self.model_tpd[(tenant, model)] = entry.tokens_per_day

    def collect(self) -> list[Metric]:
        return [
            _gauges(
                "hivenet_tenant_quota_rpm_limit", "Requests per minute", ["tenant_id"], self.rpm
            ),
            _gauges("hivenet_tenant_quota_tpd_limit", "Tokens per day", ["tenant_id"], self.tpd),
            _gauges(
                "hivenet_tenant_per_model_quota_rpm_limit",
                "Effective requests per minute (per replica times healthy replicas)",
                ["tenant_id", "model"],
                self.model_rpm,
            ),
            _gauges(
                "hivenet_tenant_per_model_quota_tpd_limit",
                "Tokens per day for the model",
                ["tenant_id", "model"],
                self.model_tpd,
            ),
            _gauges(
                "hivenet_tenant_last_request_timestamp",
                "Unix time of the tenant's last inference request",
                ["tenant_id", "key_id", "deployment_id"],
                self.last,
            ),
        ]


def _gauges(
    name: str, text: str, labels: list[str], values: Mapping[Any, float]
) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, text, labels=labels)
    for key, value in list(values.items()):
        family.add_metric(list(key) if isinstance(key, tuple) else [key], value)
    return family
