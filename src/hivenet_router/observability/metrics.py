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
from bisect import bisect_left
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:
    from hivenet_router.auth.providers import Principal

_TENANT = ("tenant_id", "key_id", "deployment_id", "model")
ROWS = 10_000  # kinds of finished request whose series cells are kept at hand
UNSET = "unset"  # deployment_id before an agent was chosen
# Waits and durations: 10 ms doubling, as the Go router buckets them, on past its 41 s to
# about 22 minutes (the Go router's last bucket held every answer over 41 s: a stream runs
# up to --max-stream-duration, 30 minutes, and its p99 read 41 s).
WAIT_BUCKETS = tuple(0.01 * 2**n for n in range(18))


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
        self._rows: dict[tuple[Any, ...], _Row] = {}
        self._server_bounds = self.http_server.bounds

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

    def policy_written(self, ok: bool) -> None:
        """A policy written through the admin API, meant to apply: a reload by the API."""
        self.policy_reload.inc(("api", "success" if ok else "error"))

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
    def _key(principal: Principal) -> tuple[str, str]:
        return principal.tenant, principal.key_id or "anonymous"

    def _refused(self, ticket: Ticket, event: Refused) -> None:
        if event.reason != "daily":
            self.admission_rejections.inc((event.reason, ticket.model))
        principal = ticket.principal
        if principal is None:
            return
        if event.reason == "b4_rpm":
            self.tenant_rate_limited.inc(self._key(principal))
        elif event.code is ErrorCode.TOKEN_LIMIT_EXCEEDED:
            self.tenant_token_limited.inc((*self._key(principal), UNSET, "input"))

    def _ended(self, ticket: Ticket, event: Ended) -> None:
        principal = ticket.principal
        seconds = event.seconds
        if ticket.job is None or principal is None:
            # not an inference request for a model the router knows
            self.http_server.observe((ticket.method, ticket.endpoint, str(event.status)), seconds)
            return
        code = event.code
        status = event.status
        answered = code is None and status < 400 and event.outcome is Outcome.OK
        agent = ticket.agent
        if agent is not None:
            deployment, region, engine = agent.deployment_id or UNSET, agent.region, agent.engine
        else:
            deployment, region, engine = UNSET, "", ""
        # Everything that picks a label of a series this request counts in, so that one
        # lookup finds all of its cells.
        key = (
            ticket.method,
            ticket.endpoint,
            status,
            principal.tenant,
            principal.key_id,
            ticket.model,
            ticket.origin,
            deployment,
            region,
            engine,
            code,
            answered,
            ticket.dispatched,
            ticket.provider,
        )
        row = self._rows.get(key)
        if row is None:
            row = self._row(key)
        counts = row.server
        counts[bisect_left(self._server_bounds, seconds)] += 1
        counts[-1] += seconds
        row.counted[0] += 1
        self.tenants.seen(row.last, principal, ticket.model, self._replicas)
        usage = event.usage
        # Every admitted answer's usage, those no engine call made for this request (a
        # cache hit, a dedup follower) included, as the audit record counts them.
        if usage is not None and ticket.admitted:
            tokens = row.tokens
            if tokens is None:
                tokens = row.tokens = (
                    self.tenant_input.cell(row.labels),
                    self.tenant_output.cell(row.labels),
                )
            tokens[0][0] += usage.input_tokens
            tokens[1][0] += usage.output_tokens
        if not row.durations:
            return  # not dispatched
        at = bisect_left(WAIT_BUCKETS, seconds)
        for counts in row.durations:
            counts[at] += 1
            counts[-1] += seconds
        for cell in row.after:
            cell[0] += 1

    def _row(self, key: tuple[Any, ...]) -> _Row:
        """The cells a finished request of this kind counts in (`_ended` says the key's
        fields). The table is bounded: past ROWS kinds it starts again, which costs only
        lookups (the series keep their values)."""
        (method, endpoint, status, tenant, key_id, model, origin, deployment, region, engine,
         code, answered, dispatched, provider) = key  # fmt: skip
        last = (tenant, key_id or "anonymous", deployment)
        labels = (*last, model)
        row = _Row(
            server=self.http_server.cell((method, endpoint, str(status))),
            counted=(self.tenant_success if answered else self.tenant_failed).cell(labels),
            last=last,
            labels=labels,
        )
        if dispatched:
            row.durations = (
                self.tenant_duration.cell(labels),
                self.request_duration.cell((tenant, origin, model, str(status))),
            )
            where = (region, engine, model, tenant)
            after = []
            if code is not None:
                after.append(self.failed.cell((*where, code.value)))
            if provider:
                if answered:
                    after.append(self.provider_fallback.cell((model, origin)))
            elif answered:
                after.append(self.routed.cell(where))
            row.after = tuple(after)
        if len(self._rows) >= ROWS:
            self._rows.clear()
        self._rows[key] = row
        return row


class _Row:
    """The cells one kind of finished request adds to."""

    __slots__ = ("after", "counted", "durations", "labels", "last", "server", "tokens")

    def __init__(
        self,
        server: list[float],
        counted: list[float],
        last: tuple[str, str, str],
        labels: tuple[str, ...],
    ) -> None:
        self.server = server  # http_server_request_duration_seconds
        self.counted = counted  # the tenant's success or failure counter
        self.last = last  # the tenant's last-request gauge's labels
        self.labels = labels  # the tenant series' labels
        # once dispatched: the tenant's and the request's duration histograms, and the
        # counters of how it ended (routed, failed, provider fallback)
        self.durations: tuple[list[float], ...] = ()
        self.after: tuple[list[float], ...] = ()
        self.tokens: tuple[list[float], list[float]] | None = None  # made at the first usage


class TenantGauges(Collector):
    """Each tenant's quota ceilings and the time of its last request, as its requests show
    them (a tenant appears with its first request)."""

    def __init__(self) -> None:
        self.rpm: dict[str, int] = {}
        self.tpd: dict[str, int] = {}
        self.model_rpm: dict[tuple[str, str], int] = {}
        self.model_tpd: dict[tuple[str, str], int] = {}
        self.last: dict[tuple[str, str, str], float] = {}

    def seen(
        self,
        last: tuple[str, str, str],
        principal: Any,
        model: str,
        replicas: Callable[[str], int],
    ) -> None:
        """Note a request of `principal` (auth.providers.Principal) for `model`; `last` is
        the last-request gauge's labels. `replicas(model)` is asked only for a per-model
        quota, whose ceiling scales with the healthy agents (a registry walk)."""
        self.last[last] = time.time()
        quota = principal.quota
        tenant = principal.tenant
        if quota.per_model is None:
            # No limit (0) removes the series: a limit taken away by a reload must not
            # keep showing (and alerting on) the old one.
            if quota.requests_per_minute:
                self.rpm[tenant] = quota.requests_per_minute
            else:
                self.rpm.pop(tenant, None)
            if quota.tokens_per_day:
                self.tpd[tenant] = quota.tokens_per_day
            else:
                self.tpd.pop(tenant, None)
            return
        entry = quota.per_model.get(model)
        if entry is not None:
            self.model_rpm[(tenant, model)] = entry.rpm_per_replica * replicas(model)
            self.model_tpd[(tenant, model)] = entry.tokens_per_day

    def reloaded(self, quotas: Mapping[str, Any]) -> None:
        """The keys were read again (auth.config.Quota by tenant): each tenant shown takes
        its new ceilings now rather than at its next request, and one no longer listed (or
        whose limit went) loses its series. A per-model ceiling that scales with the
        healthy replicas waits for the tenant's next request, which counts them."""
        for tenant in list(self.rpm.keys() | self.tpd.keys()):
            quota = quotas.get(tenant)
            flat = quota is not None and quota.per_model is None
            for shown, limit in ((self.rpm, "requests_per_minute"), (self.tpd, "tokens_per_day")):
                value = getattr(quota, limit) if flat else 0
                if value:
                    shown[tenant] = value
                else:
                    shown.pop(tenant, None)
        for tenant, model in list(self.model_tpd.keys() | self.model_rpm.keys()):
            quota = quotas.get(tenant)
            entry = quota.per_model.get(model) if quota is not None and quota.per_model else None
            if entry is None:
                self.model_tpd.pop((tenant, model), None)
                self.model_rpm.pop((tenant, model), None)
            else:
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
