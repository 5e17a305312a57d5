"""The router's object graph, built once at start.

This is the one place that knows every part: it builds the state ports, the observers, the
stage list and the terminal, and picks stages and observers by name from configuration
(`HIVENET_ROUTER_STAGES`, `HIVENET_ROUTER_OBSERVERS`). A later layer lands as a new module
and one entry in a table below; nothing on the request path changes.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from hivenet_router.auth.providers import AuthState
from hivenet_router.clock import Clock
from hivenet_router.config.options import ConfigError
from hivenet_router.config.router import RouterConfig
from hivenet_router.domain.site import SiteDirectory, SiteRouter, default_router_id
from hivenet_router.gateway.blocks import GATEWAY_BLOCKS
from hivenet_router.gateway.cache import ResponseCache
from hivenet_router.gateway.validator import StreamValidator
from hivenet_router.http1.messages import Answer, App, Request
from hivenet_router.observability.audit import AuditObserver
from hivenet_router.observability.cache_metrics import CacheCollector
from hivenet_router.observability.collectors import (
    AgentCollector,
    RequestsCollector,
    StateCollector,
)
from hivenet_router.observability.events import Observers, RequestObserver
from hivenet_router.observability.linewriter import STDERR, LineWriter, WriterCollector
from hivenet_router.observability.metrics import MetricsObserver
from hivenet_router.observability.requestlog import RequestLog
from hivenet_router.observability.routing_metrics import RoutingCollector
from hivenet_router.observability.spans import configured
from hivenet_router.observability.sync_metrics import SyncCollector
from hivenet_router.observability.tracing import Tracing, TracingCollector
from hivenet_router.observability.validator_metrics import ValidatorCollector, ValidatorMetrics
from hivenet_router.observability.wallet_metrics import WalletCollector
from hivenet_router.pipeline.stage import Next, Stage, build
from hivenet_router.policy.document import BUILT_IN, Policy
from hivenet_router.policy.signals import AgentFacts
from hivenet_router.policy.store import PolicyStore
from hivenet_router.responses.store import ResponseStore, SqliteResponses
from hivenet_router.responses.store_pg import PgResponses
from hivenet_router.router.admin import AdminApi
from hivenet_router.router.admission import Admission
from hivenet_router.router.agent_auth import AgentAuthenticator, Sessions
from hivenet_router.router.body_reader import BodyReader
from hivenet_router.router.control import ControlPlane
from hivenet_router.router.cors import Cors
from hivenet_router.router.dispatch import Dispatcher
from hivenet_router.router.edge import Edge, Handler, build_app
from hivenet_router.router.forwarding import DispatchLimits
from hivenet_router.router.handlers import Handlers
from hivenet_router.router.health import HealthMonitor
from hivenet_router.router.history import HistoryKeeper
from hivenet_router.router.providers import Providers
from hivenet_router.router.rate import RequestRate
from hivenet_router.router.registry import AgentRecord, Registry
from hivenet_router.router.relay import Relay
from hivenet_router.router.responses_api import ResponsesApi
from hivenet_router.state.local import DailyCounter, LocalPool, RateCounter
from hivenet_router.state.ports import Ports
from hivenet_router.storage.history import HistoryStore

if TYPE_CHECKING:  # imported where they are built: a router without wallets or a site of
    # routers never loads asyncpg or the Valkey client (about 8 MiB of memory)
    from hivenet_router.gateway.ledger import Ledger
    from hivenet_router.sync.site import Site


@dataclass(frozen=True, slots=True)
class Shared:
    """What the process made before the graph: configuration, clock, files already read."""

    config: RouterConfig
    clock: Clock
    policies: PolicyStore
    providers: Providers
    auth: AuthState
    secret: bytes
    peer_id: str
    announce: str


@dataclass(slots=True)
class Router:
    """Every long-lived part of a running router."""

    registry: Registry
    metrics: MetricsObserver
    observers: Observers
    rate: RequestRate
    admission: Admission
    daily: DailyCounter
    dispatcher: Dispatcher
    relay: Relay
    edge: Edge
    public_app: App
    sessions: Sessions
    authenticator: AgentAuthenticator
    control: ControlPlane
    keeper: HistoryKeeper
    monitor: HealthMonitor
    admin: AdminApi
    directory: SiteDirectory
    # The site store (--sync-store=valkey): shared limits and credits; None alone.
    site: Site | None = None
    # Lines written off the event loop (audit records, the request log): reopened on
    # SIGHUP, flushed and closed at shutdown.
    writers: dict[str, LineWriter] = field(default_factory=dict)
    # OpenTelemetry, when OTEL_EXPORTER_OTLP_ENDPOINT asks for it: a stage and an observer.
    tracing: Tracing | None = None
    # The wallets' ledger (--ledger-dsn): run beside the chores, closed at shutdown.
    ledger: Ledger | None = None
    policy_for: Callable[[str], Policy] = field(default=lambda model: BUILT_IN)
    validator_metrics: ValidatorMetrics = field(default_factory=ValidatorMetrics)
    # The cache stage, when the stage list has it: closed at shutdown (its engine calls and
    # site locks) before the site store's client.
    cache: ResponseCache | None = None
    # Reads request bodies, the costly ones in a child process: stopped at shutdown.
    bodies: BodyReader = field(default_factory=BodyReader)
    # Stored Responses API responses: opened by the process before it serves, closed last.
    responses: ResponseStore | None = None
    # Public routes that need no key, of later layers: the console's files (--console).
    pages: list[tuple[str, str, Handler]] = field(default_factory=list)


def _audit(router: Router, cfg: RouterConfig) -> RequestObserver | None:
    if not cfg.audit_log_path:
        return None
    writer = router.writers["audit"] = LineWriter(cfg.audit_log_path, what="audit")
    return AuditObserver(writer)


def _access(router: Router, cfg: RouterConfig) -> RequestObserver:
    writer = router.writers["access"] = LineWriter(STDERR, what="access log")
    return RequestLog(writer, cfg.log_format)


def _wallet(router: Router) -> Stage | None:
    if router.ledger is None:
        return None  # no --ledger-dsn: wallets are off
    from hivenet_router.gateway.wallet import WalletStage  # noqa: PLC0415 (see TYPE_CHECKING)

    return WalletStage(router.ledger)


def _cache(router: Router) -> Stage:
    site = router.site
    extra = (site.client, site.keys.prefix) if site is not None else ()
    stage = router.cache = ResponseCache(router.dispatcher.clock, *extra)
    router.metrics.add(CacheCollector(stage.snapshot))
    return stage


def _validator(router: Router) -> Stage:
    return StreamValidator(router.dispatcher.to_provider, metrics=router.validator_metrics)


# Stages and observers by the names configuration uses for them. A factory may return None:
# configured off (wallets without a ledger, the audit log with no path).
STAGES: dict[str, Callable[[Router], Stage | None]] = {
    "rate": lambda router: router.rate,
    "admission": lambda router: router.admission,
    "wallet": _wallet,
    "cache": _cache,
    "validator": _validator,
}
OBSERVERS: dict[str, Callable[[Router, RouterConfig], RequestObserver | None]] = {
    "metrics": lambda router, cfg: router.metrics,
    "audit": _audit,
    "access": _access,
}
# Policy sections other layers own (policy/blocks.py), in the order they are parsed and
# published; handed to the policy store at start (router/process.py).
POLICY_BLOCKS = (*GATEWAY_BLOCKS,)


# Stages whose order decides what is billed and what is counted: the request rate comes
# before everything that takes a shared resource (else a tenant past its rate still takes
# a wallet hold from the ledger's pool, and cache hits and dedup followers skip the rate);
# admission's limits come before the wallet (a request refused by a limit never touches
# the ledger, and the wallet lowers the output bound admission set to what the balance
# pays for); the wallet must hold before the cache serves (else hits and shared answers
# are never billed) and before the validator (else it bills a rejected attempt and its
# replacement both).
_BEFORE = {
    "rate": ("wallet", "cache", "admission", "validator"),
    "admission": ("wallet",),
    "wallet": ("cache", "validator"),
}


def check_names(config: RouterConfig) -> None:
    """Refuse, at start, a stage or observer this router does not have, one named twice
    (it would hold and charge twice), stages in an order that bills or counts wrongly, or
    admission without the rate."""
    for kind, names, table in (
        ("HIVENET_ROUTER_STAGES", config.stages, STAGES),
        ("HIVENET_ROUTER_OBSERVERS", config.observers, OBSERVERS),
    ):
        unknown = [name for name in names if name not in table]
        if unknown:
            raise ConfigError(f"{kind}: unknown {', '.join(unknown)} (known: {', '.join(table)})")
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ConfigError(f"{kind}: {', '.join(twice)} named more than once")
    stages = list(config.stages)
    if "admission" in stages and "rate" not in stages:
        # Admission counted requests before the rate became a stage of its own: a list
        # written then would silently lose the rate limit.
        raise ConfigError(
            "HIVENET_ROUTER_STAGES: admission needs rate before it (the request rate is "
            f"its own stage; default order: {', '.join(STAGES)})"
        )
    for first, laters in _BEFORE.items():
        for later in laters:
            if first in stages and later in stages and stages.index(later) < stages.index(first):
                raise ConfigError(
                    f"HIVENET_ROUTER_STAGES: {first} must come before {later} "
                    f"(default order: {', '.join(STAGES)})"
                )


def local_ports(config: RouterConfig, clock: Clock) -> tuple[Ports, DailyCounter]:
    """The in-process state ports (one router; shared ones plug in here)."""
    daily = DailyCounter(clock)
    ports = Ports(
        rates=RateCounter(clock, config.rpm_burst_seconds),
        daily=daily,
        input_rates=RateCounter(clock),
        output_rates=RateCounter(clock),
        occupancy=LocalPool(clock, alone_fits=True),
        shares=LocalPool(clock, alone_fits=False),
    )
    return ports, daily


def _state(
    shared: Shared, registry: Registry
) -> tuple[SiteDirectory, Site | None, Ports, DailyCounter]:
    """Where limits are kept: in this process, or shared with the site through the store."""
    cfg = shared.config
    directory = SiteDirectory(
        SiteRouter(
            cfg.router_id or default_router_id(cfg.grpc_port.port),
            shared.peer_id,
            cfg.advertise_grpc_addr,
        )
    )
    if cfg.sync_store != "valkey":
        return (directory, None, *local_ports(cfg, shared.clock))
    from hivenet_router.sync.site import Site  # noqa: PLC0415 (see TYPE_CHECKING)

    site = Site(cfg, shared.clock, directory)
    registry.listen(site.on_registration)
    site.reports = lambda: [agent.routers_up for agent in registry.all() if agent.connected]
    return directory, site, site.ports(), site.daily


def dispatch_limits(config: RouterConfig) -> DispatchLimits:
    return DispatchLimits(
        queue_size=config.queue_size,
        max_concurrent=config.max_concurrent,
        enqueue_timeout=config.enqueue_timeout,
        queue_depth=config.queue_depth,
        max_tries=config.max_tries_per_step,
        ceiling=config.http_max_conns,
    )


def assemble(
    shared: Shared,
    store: HistoryStore,
    remove_agent: Callable[[AgentRecord], None],
    reload: Callable[[], object],
) -> Router:
    """Build the graph. `remove_agent` and `reload` are the process's own actions (they
    touch tasks and files), handed to the parts that trigger them."""
    cfg, clock, policies = shared.config, shared.clock, shared.policies
    registry = Registry()
    metrics = MetricsObserver(
        replicas=lambda model: sum(1 for agent in registry.for_model(model) if agent.eligible)
    )
    shared.providers.on_call = metrics.provider_call
    observers = Observers()  # filled once the named observers exist, below
    tracing = Tracing(os.environ) if configured(os.environ) else None

    def policy_for(model: str) -> Policy:
        return policies.current.for_model(model)  # the snapshot in force now

    def healthy(model: str) -> list[AgentFacts]:
        return [agent for agent in registry.for_model(model) if agent.eligible]

    directory, site, ports, daily = _state(shared, registry)
    admission = Admission(clock, healthy, ports, cfg.admit_fraction, cfg.admit_park_timeout)
    rate = RequestRate(ports.rates, healthy)
    dispatcher = Dispatcher(registry, clock, dispatch_limits(cfg), policies, shared.providers)
    sessions = Sessions(clock, cfg.session_ttl)
    keeper = HistoryKeeper(registry, store, cfg.universal_flush_interval)
    router = Router(
        registry=registry,
        metrics=metrics,
        observers=observers,
        rate=rate,
        admission=admission,
        daily=daily,
        dispatcher=dispatcher,
        relay=Relay(cfg.stream_idle_timeout),
        tracing=tracing,
        edge=_edge(shared, observers, tracing),
        public_app=_not_yet,
        sessions=sessions,
        authenticator=_authenticator(shared, sessions, directory),
        directory=directory,
        site=site,
        control=ControlPlane(
            registry=registry,
            observers=observers,
            clock=clock,
            sessions=sessions,
            router_peer_id=shared.peer_id,
            history=keeper,
            site_routers=directory.routers,
        ),
        keeper=keeper,
        monitor=HealthMonitor(
            registry,
            observers,
            clock,
            unhealthy_after=cfg.unhealthy_after,
            remove_after=cfg.remove_after,
            on_remove=remove_agent,
        ),
        admin=AdminApi(
            registry=registry,
            dispatcher=dispatcher,
            policies=policies,
            clock=clock,
            remove_agent=remove_agent,
            reload=reload,  # type: ignore[arg-type]
            daily=daily,
            auth=shared.auth,
            history=keeper,
            body_timeout=cfg.http_body_timeout,
            sync_view=site.view if site is not None else None,
            site_usage=site.usage if site is not None else None,
            policy_written=metrics.policy_written,
        ),
    )
    _gateway(router, cfg, policy_for)
    built = [OBSERVERS[name](router, cfg) for name in cfg.observers]
    if cfg.console:
        built.append(_console(router))
    if tracing is not None:
        built.append(tracing)
    observers.observers = tuple(observer for observer in built if observer is not None)
    _collect(router)
    router.responses = _responses(cfg, clock)
    router.public_app = _public_app(shared, router)
    return router


def _gateway(router: Router, cfg: RouterConfig, policy_for: Callable[[str], Policy]) -> None:
    """The policy lookup (the handlers resolve each request's policy with it, once) and,
    with --ledger-dsn, the ledger and its admin routes."""
    router.policy_for = policy_for
    if cfg.ledger_dsn:
        from hivenet_router.gateway.ledger import Ledger  # noqa: PLC0415 (as above)
        from hivenet_router.router.admin_wallets import WalletApi  # noqa: PLC0415

        router.ledger = Ledger(cfg.ledger_dsn, Path(cfg.disk_db_path), cfg.ledger_timeout)
        router.admin.more.extend(WalletApi(router.ledger, cfg.http_body_timeout).routes())


def _responses(cfg: RouterConfig, clock: Clock) -> ResponseStore:
    """Stored responses: in the ledger's PostgreSQL when there is one (shared by the site's
    routers), else in SQLite beside the history store."""
    ttl, most = cfg.responses_store_ttl, cfg.responses_store_max_bytes
    if cfg.ledger_dsn:
        return PgResponses(cfg.ledger_dsn, ttl, most, cfg.ledger_timeout, clock.wall)
    return SqliteResponses(Path(cfg.disk_db_path), ttl, most, clock.wall)


def _console(router: Router) -> RequestObserver:
    """The operator's console (--console): its pages on the public port, and the admin
    routes it reads (the latest requests, the last hour) from the observer it adds."""
    from hivenet_router.console.assets import ConsoleAssets  # noqa: PLC0415 (only when on)
    from hivenet_router.console.recent import RecentRequests  # noqa: PLC0415

    recent = RecentRequests()
    router.admin.more.extend(recent.routes())
    router.pages.extend(ConsoleAssets().routes())
    return recent


def _edge(shared: Shared, observers: Observers, tracing: Tracing | None) -> Edge:
    origins = shared.config.cors_allowed_origins
    return Edge(shared.auth, observers, Cors(origins) if origins else None, tracing)


def _authenticator(
    shared: Shared, sessions: Sessions, directory: SiteDirectory
) -> AgentAuthenticator:
    cfg = shared.config
    return AgentAuthenticator(
        secret=shared.secret,
        sessions=sessions,
        clock=shared.clock,
        router_peer_id=shared.peer_id,
        announce=shared.announce,
        heartbeat_interval=cfg.heartbeat_interval,
        renew_margin=cfg.session_renew_margin,
        failure_limit=cfg.auth_failure_limit,
        router_id=directory.me.router_id,
        site_routers=directory.routers,
    )


async def _not_yet(request: Request) -> Answer:
    raise RuntimeError("the public routes are built once the router is")


def _public_app(shared: Shared, router: Router) -> App:
    cfg, clock = shared.config, shared.clock
    warm_until = clock.monotonic() + cfg.warmup
    stages = [stage for name in cfg.stages if (stage := STAGES[name](router)) is not None]
    if router.tracing is not None:
        stages.insert(0, router.tracing)  # first: admission's own time is a span
    pipeline: Next = build(stages, router.dispatcher)
    handlers = Handlers(
        pipeline,
        router.relay,
        router.registry,
        router.dispatcher.claims,
        cfg.request_timeout,
        body_timeout=cfg.http_body_timeout,
        max_stream_duration=cfg.max_stream_duration,
        warming=lambda: clock.monotonic() < warm_until,
        reader=router.bodies,
        policy_for=router.policy_for,
    )
    # The Responses API runs on the same handlers, translated (responses/).
    responses = ResponsesApi(handlers, router.responses, cfg.http_body_timeout)
    return build_app(handlers, router.admin, router.edge, responses.routes(), router.pages)


def _collect(router: Router) -> None:
    """State the metrics read at scrape time."""
    router.metrics.add(WriterCollector(router.writers))
    if router.tracing is not None:
        router.metrics.add(TracingCollector(router.tracing.buffer))
    registry, admission, pending = router.registry, router.admission, router.dispatcher.pending
    occupancy = admission.ports.occupancy
    router.metrics.add(
        AgentCollector(
            lambda: [
                (agent, agent.link.active_streams if agent.link is not None else 0)
                for agent in registry.all()
            ]
        )
    )
    router.metrics.add(
        StateCollector(
            occupancy=occupancy.levels if isinstance(occupancy, LocalPool) else lambda: (),
            limits=lambda: list(admission.limits.items()),
            waiting=router.dispatcher.waiting,
            pending=lambda: (pending.waiting, pending.forwarding, pending.limit),
        )
    )
    routing = router.dispatcher.routing
    router.control.cache_report = routing.cache_report
    router.metrics.add(
        RoutingCollector(
            breakers=routing.breakers,
            limits=routing.limits,
            prefixes=routing.prefix_blocks,
            errors=routing.prediction_errors,
            reports=lambda: routing.reports,
        )
    )
    if router.site is not None:
        router.metrics.add(SyncCollector(router.site.snapshot))
    router.metrics.add(ValidatorCollector(router.validator_metrics))
    if router.ledger is not None:
        router.metrics.add(WalletCollector(router.ledger.snapshot))
    router.metrics.add(
        RequestsCollector(
            inflight=lambda: list(router.edge.inflight.values()),
            used_today=lambda: list(router.daily.today()[1].items()),
        )
    )
