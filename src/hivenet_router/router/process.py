"""Build the router's object graph once and run its listeners until told to stop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sqlite3
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from hivenet_router.auth.config import AuthConfigError
from hivenet_router.auth.providers import AuthSettings, AuthState
from hivenet_router.auth.serverless import itpm_conflict
from hivenet_router.clock import Clock, SystemClock
from hivenet_router.config.options import ConfigError, describe
from hivenet_router.config.router import RouterConfig
from hivenet_router.domain.errors import ErrorCode, error_body
from hivenet_router.listeners import (
    ConnectionGuard,
    connection_budget,
    raise_open_files_limit,
)
from hivenet_router.policy.document import Policy, PolicyError
from hivenet_router.policy.signals import AgentFacts
from hivenet_router.policy.store import PolicyStore
from hivenet_router.router.admin import AdminApi
from hivenet_router.router.admission import Admission
from hivenet_router.router.agent_auth import AgentAuthenticator, Sessions
from hivenet_router.router.app import Edge, build_app
from hivenet_router.router.auth_grpc import GrpcAuthServer
from hivenet_router.router.control import ControlPlane
from hivenet_router.router.dispatch import Dispatcher, DispatchLimits
from hivenet_router.router.handlers import Handlers
from hivenet_router.router.health import HealthMonitor
from hivenet_router.router.history import HistoryKeeper
from hivenet_router.router.metrics import AdmissionCollector, LinkCollector, RouterMetrics
from hivenet_router.router.providers import ProviderConfig, Providers
from hivenet_router.router.registry import AgentRecord, Registry
from hivenet_router.runtime import start_site
from hivenet_router.storage.history import SqliteHistory
from hivenet_router.storage.history import reset as reset_store
from hivenet_router.transport import trust
from hivenet_router.transport.identity import peer_id_of
from hivenet_router.transport.tls import RouterTlsIdentity, derive_key

log = logging.getLogger("hivenet.router")

SWEEP_INTERVAL = 300.0  # idle admission state is forgotten every five minutes


def _refusal() -> bytes:
    """What a connection over the per-address cap reads before it is closed."""
    body = error_body(ErrorCode.QUEUE_FULL, "too many open connections from this address")
    head = (
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        f"Retry-After: 1\r\nConnection: close\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


TOO_MANY_CONNECTIONS = _refusal()
LINK_REFUSAL = (
    b"HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json\r\n"
    b"Connection: close\r\nContent-Length: 50\r\n\r\n"
    b'{"error":"too many connections from this address"}'
)


def provider_configs(config: RouterConfig) -> dict[str, ProviderConfig]:
    """Provider adapters exist only for credentials present at start."""
    configs = {}
    if config.openai_api_key:
        configs["openai"] = ProviderConfig("openai", config.openai_base_url, config.openai_api_key)
    if config.anthropic_api_key:
        configs["anthropic"] = ProviderConfig(
            "anthropic", config.anthropic_base_url, config.anthropic_api_key
        )
    return configs


class RouterProcess:
    def __init__(
        self,
        config: RouterConfig,
        secret: bytes,
        clock: Clock,
        policies: PolicyStore,
        providers: Providers,
        auth: AuthState,
    ) -> None:
        self.auth = auth
        self.policies = policies
        self.providers = providers
        self.config = config
        self.secret = secret
        self.clock = clock
        self.tls = RouterTlsIdentity.from_secret(secret)
        self.peer_id = peer_id_of(derive_key(secret).public_key())

    @classmethod
    def build(cls, config: RouterConfig) -> RouterProcess:
        try:
            secret = trust.load_secret(config.jwt_secret_file, config.jwt_secret)
        except trust.TrustError as exc:
            raise ConfigError(str(exc)) from None
        providers = Providers(provider_configs(config))
        policies = PolicyStore(config.policy_file, config.policy_model_dir, providers.available)
        try:
            policies.load()
        except PolicyError as exc:
            raise ConfigError(f"invalid policy: {exc}") from None
        try:
            auth = AuthState(
                AuthSettings(
                    file=config.auth_config_file,
                    env_mode=config.auth_mode,
                    admin_keys=config.admin_api_keys,
                    allow_insecure_admin=config.allow_insecure_admin,
                ),
                # Keys are judged against the policies in force, now and after reloads.
                check=lambda name, models, quota: itpm_conflict(
                    name, models, quota, policies.current
                ),
            )
        except AuthConfigError as exc:
            raise ConfigError(f"authentication: {exc}") from None
        policies.check = lambda candidate: auth.conflict(
            lambda name, models, quota: itpm_conflict(name, models, quota, candidate)
        )
        return cls(config, secret, SystemClock(), policies, providers, auth)

    def _announce(self) -> str:
        cfg = self.config
        if cfg.p2p_announce_addr:
            return cfg.p2p_announce_addr
        host = cfg.p2p_listen_addr
        proto = "ip6" if ":" in host else "ip4"
        return f"/{proto}/{host}/tcp/{cfg.p2p_port}/tls/ws"

    async def serve(self, stop: asyncio.Event) -> int:
        cfg = self.config
        metrics = RouterMetrics()
        registry = Registry(metrics)
        dispatcher = Dispatcher(
            registry,
            metrics,
            self.clock,
            DispatchLimits(
                queue_size=cfg.queue_size,
                max_concurrent=cfg.max_concurrent,
                enqueue_timeout=cfg.enqueue_timeout,
                queue_depth=cfg.queue_depth,
                max_tries=cfg.max_tries_per_step,
            ),
            self.policies,
            self.providers,
        )

        def policy_for(model: str) -> Policy:
            return self.policies.current.for_model(model)  # the snapshot in force now

        def healthy(model: str) -> list[AgentFacts]:
            return [agent for agent in registry.for_model(model) if agent.eligible]

        admission = Admission(
            self.clock,
            policy_for,
            healthy,
            cfg.rpm_burst_seconds,
            cfg.admit_fraction,
            cfg.admit_park_timeout,
        )
        metrics.registry.register(AdmissionCollector(admission))
        metrics.registry.register(
            LinkCollector(
                lambda: [
                    (a.peer_id, a.model, a.link.active_streams)
                    for a in registry.all()
                    if a.link is not None
                ]
            )
        )
        admission.rejections = lambda reason, model: metrics.admission_rejections.labels(
            reason, model
        ).inc()
        warm_until = self.clock.monotonic() + cfg.warmup
        handlers = Handlers(
            dispatcher,
            registry,
            metrics,
            cfg.request_timeout,
            admission,
            body_timeout=cfg.http_body_timeout,
            warming=lambda: self.clock.monotonic() < warm_until,
        )
        sessions = Sessions(self.clock, cfg.session_ttl)
        authenticator = AgentAuthenticator(
            secret=self.secret,
            sessions=sessions,
            clock=self.clock,
            router_peer_id=self.peer_id,
            announce=self._announce(),
            heartbeat_interval=cfg.heartbeat_interval,
            renew_margin=cfg.session_renew_margin,
            failure_limit=cfg.auth_failure_limit,
        )
        store_dir = Path(cfg.disk_db_path)
        if cfg.reset_disk_db:
            log.warning("--reset-disk-db: deleting the history database in %s", store_dir)
            reset_store(store_dir)
        store = SqliteHistory(store_dir, cfg.disk_db_ttl, self.clock.wall)
        try:
            await store.open()
        except (OSError, sqlite3.Error) as exc:
            log.error("cannot open the persistent store in %s: %s", store_dir, exc)
            return 1
        keeper = HistoryKeeper(registry, store, cfg.universal_flush_interval)
        control = ControlPlane(
            registry=registry,
            metrics=metrics,
            clock=self.clock,
            sessions=sessions,
            router_peer_id=self.peer_id,
            history=keeper,
        )

        background: set[asyncio.Task[None]] = set()

        def spawn(coro: Coroutine[Any, Any, None]) -> None:
            task = asyncio.create_task(coro)
            background.add(task)
            task.add_done_callback(background.discard)

        def removed(record: AgentRecord) -> None:
            sessions.revoke_peer(record.peer_id)
            spawn(keeper.flush([record]))
            if record.link is not None:
                spawn(record.link.close("agent removed"))

        async def reload(trigger: str) -> dict[str, bool]:
            # Files are read off the event loop; each swap itself is one assignment.
            policies = await asyncio.to_thread(self.policies.reload)
            metrics.policy_reload.labels(trigger, "success" if policies else "error").inc()
            auth = await asyncio.to_thread(self.auth.reload)
            return {"policies": policies, "auth": auth}

        admin = AdminApi(
            registry=registry,
            dispatcher=dispatcher,
            policies=self.policies,
            clock=self.clock,
            remove_agent=removed,
            reload=lambda: reload("admin"),
            daily=admission.daily,
            auth=self.auth,
            body_timeout=cfg.http_body_timeout,
        )

        monitor = HealthMonitor(
            registry,
            metrics,
            self.clock,
            unhealthy_after=cfg.unhealthy_after,
            remove_after=cfg.remove_after,
            on_remove=removed,
        )

        async def metrics_page(request: web.Request) -> web.Response:
            return web.Response(
                body=generate_latest(metrics.registry),
                headers={"Content-Type": CONTENT_TYPE_LATEST},
            )

        metrics_app = web.Application()
        metrics_app.router.add_get("/metrics", metrics_page)

        server_tls = self.tls.server_context()
        auth_server = GrpcAuthServer(authenticator, server_tls)
        runners: list[web.AppRunner] = []
        edge = Edge(metrics, self.auth)
        open_files = raise_open_files_limit()
        client_conns = connection_budget(cfg.http_max_conns, open_files)
        if client_conns < cfg.http_max_conns:
            log.warning(
                "open-files limit %d allows %d client connections, not --http-max-conns %d",
                open_files,
                client_conns,
                cfg.http_max_conns,
            )
        try:
            public = await start_site(
                build_app(handlers, admin, edge, cfg.body_limit),
                cfg.http_port.host,
                cfg.http_port.port,
                shutdown_timeout=1.0,
                guard=ConnectionGuard("client API", cfg.http_max_conns_per_ip, client_conns),
                refusal=TOO_MANY_CONNECTIONS,
                idle_timeout=cfg.http_idle_timeout,
            )
            runners.append(public)
            await auth_server.start(cfg.grpc_port.host, cfg.grpc_port.port)
            runners.append(
                await start_site(
                    control.link_app(),
                    cfg.p2p_listen_addr,
                    cfg.p2p_port,
                    ssl_context=server_tls,
                    guard=ConnectionGuard(
                        "agent link",
                        cfg.p2p_max_conns_per_ip,
                        connection_budget(cfg.http_max_conns, open_files),
                    ),
                    refusal=LINK_REFUSAL,
                    idle_timeout=cfg.p2p_handshake_timeout,
                    handshake_timeout=cfg.p2p_handshake_timeout,
                )
            )
            runners.append(
                await start_site(metrics_app, cfg.metrics_port.host, cfg.metrics_port.port)
            )
        except (OSError, RuntimeError) as exc:
            log.error("cannot listen: %s", exc)
            await auth_server.stop()
            for runner in runners:
                await runner.cleanup()
            return 1
        log.info(
            "router %s ready: http %s, agent auth %s, agent link %s, metrics %s",
            self.peer_id,
            cfg.http_port,
            cfg.grpc_port,
            self._announce(),
            cfg.metrics_port,
        )
        log.debug("configuration: %s", describe(cfg))
        persistent_quota = cfg.quota_backend == "badger"

        async def save_quota() -> None:
            if persistent_quota:
                day, totals = admission.daily.today()
                try:
                    await store.save_tokens(day, totals)
                except sqlite3.Error as exc:
                    log.error("cannot save daily token totals: %s", exc)

        async def quota_flusher() -> None:
            while True:
                await asyncio.sleep(cfg.universal_flush_interval)
                await save_quota()

        if persistent_quota:
            day, _ = admission.daily.today()
            admission.daily.restore(day, await store.load_tokens(day))

        async def sweeper() -> None:
            while True:
                await asyncio.sleep(SWEEP_INTERVAL)
                admission.sweep()

        health_task = asyncio.create_task(monitor.run(cfg.health_check_interval))
        flush_task = asyncio.create_task(keeper.run())
        quota_task = asyncio.create_task(quota_flusher())
        sweep_task = asyncio.create_task(sweeper())

        async def hangup() -> None:
            await reload("sighup")

        def on_hangup() -> None:
            log.info("SIGHUP: reloading policies and auth")
            spawn(hangup())

        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, on_hangup)
        await stop.wait()
        log.info(
            "shutting down: no new requests; %d in flight get up to %gs",
            len(edge.inflight),
            cfg.shutdown_grace,
        )
        # The public port closes first, while agent connections still carry what is in
        # flight; only then do the agents hear that the router is going away.
        for site in public.sites:
            await site.stop()
        cut = await edge.drain(cfg.shutdown_grace, lambda: setattr(handlers, "stopping", True))
        if cut:
            log.warning("shutdown grace over: cut %d request(s) still in flight", cut)
        await public.cleanup()
        for task in (health_task, flush_task, quota_task, sweep_task):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await keeper.flush()
        await save_quota()
        await store.close()
        for link in list(control.links):
            await link.close("router shutting down")
        await auth_server.stop()
        await self.providers.close()
        for runner in runners[1:]:
            await runner.cleanup()
        return 0
