"""The router process: read configuration and files, open the store, start listeners,
handle signals, and shut down within the announced grace. The object graph itself is built
in router/wiring.py."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sqlite3
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from hivenet_router.auth.config import AuthConfigError
from hivenet_router.auth.providers import AuthSettings, AuthState, StaticKeys
from hivenet_router.auth.serverless import itpm_conflict
from hivenet_router.clock import Clock, SystemClock
from hivenet_router.config.options import ConfigError, describe
from hivenet_router.config.router import RouterConfig
from hivenet_router.domain.errors import ErrorCode, error_body
from hivenet_router.gateway.blocks import missing_prices
from hivenet_router.gateway.ledger_dsn import dsn_problem
from hivenet_router.http1.guard import ConnectionGuard, address_prefix
from hivenet_router.http1.server import HttpServer, Limits
from hivenet_router.http1.tlsgate import TlsGate
from hivenet_router.listeners import (
    PortCaps,
    QuietServerLog,
    gate_of,
    raise_open_files_limit,
    share_descriptors,
    start_site,
)
from hivenet_router.observability.connections import ConnectionsCollector
from hivenet_router.policy.reader import PolicyError
from hivenet_router.policy.store import PolicySet, PolicyStore
from hivenet_router.router.auth_grpc import GrpcAuthServer
from hivenet_router.router.providers import ProviderConfig, Providers
from hivenet_router.router.registry import AgentRecord
from hivenet_router.router.requests import MAX_HEADER_BYTES
from hivenet_router.router.wiring import POLICY_BLOCKS, Router, Shared, assemble, check_names
from hivenet_router.storage.history import SqliteHistory, StoreInUse
from hivenet_router.transport import trust
from hivenet_router.transport.identity import peer_id_of
from hivenet_router.transport.tls import GRPC_ALPN, RouterTlsIdentity, derive_key

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
METRICS_REFUSAL = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\n"
    b"Retry-After: 1\r\nConnection: close\r\nContent-Length: 25\r\n\r\n"
    b"too many open connections"
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
        policies = PolicyStore(
            config.policy_file, config.policy_model_dir, providers.available, POLICY_BLOCKS
        )
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
        policies.check = lambda candidate: (
            auth.conflict(lambda name, models, quota: itpm_conflict(name, models, quota, candidate))
            or _unpriced(config, candidate)
        )
        problem = _unpriced(config, policies.current)
        if problem is not None:
            raise ConfigError(problem)
        check_names(config)
        if config.ledger_dsn and (problem := dsn_problem(config.ledger_dsn)) is not None:
            raise ConfigError(problem)
        if config.sync_store == "valkey":
            # Only with a store: it loads the Valkey client (tests/unit/test_imports.py).
            from hivenet_router.sync.store import password_of  # noqa: PLC0415

            password_of(config.sync_password_file)  # unreadable or empty: refused now
        return cls(config, secret, SystemClock(), policies, providers, auth)

    def _announce(self) -> str:
        cfg = self.config
        if cfg.p2p_announce_addr:
            return cfg.p2p_announce_addr
        # An empty bind address is every interface: announced as 0.0.0.0, which agents
        # replace with the address they reached the router at.
        host = cfg.p2p_listen_addr or "0.0.0.0"
        proto = "ip6" if ":" in host else "ip4"
        return f"/{proto}/{host}/tcp/{cfg.p2p_port}/tls/ws"

    async def serve(self, stop: asyncio.Event) -> int:
        cfg = self.config
        store = await self._open_store()
        if store is None:
            return 1
        background = _Background()
        router = assemble(
            Shared(
                cfg,
                self.clock,
                self.policies,
                self.providers,
                self.auth,
                self.secret,
                self.peer_id,
                self._announce(),
            ),
            store,
            remove_agent=lambda record: self._removed(router, background, record),
            reload=lambda: self._reload(router, "api"),
        )
        if router.site is not None and (holder := await router.site.claimed_by()) is not None:
            log.error(
                "--router-id %s is taken: another live router process of site %s runs "
                "under it: %s. Give every router of the site its own --router-id",
                router.site.me,
                cfg.site,
                holder,
            )
            await router.site.client.aclose()
            await store.close()
            return 1
        if not await _open_responses(router):
            await store.close()
            return 1
        guards = self._guards()
        router.metrics.registry.register(ConnectionsCollector(lambda: guards))
        auth_server = GrpcAuthServer(
            router.authenticator,
            self.tls.server_context(GRPC_ALPN),
            guards["agent authentication"],
            cfg.grpc_conn_timeout,
        )
        listening = await self._listen(router, auth_server, guards)
        if listening is None:
            return 1
        log.info(
            "router %s ready: http %s, agent auth %s, agent link %s, metrics %s",
            self.peer_id,
            cfg.http_port,
            cfg.grpc_port,
            self._announce(),
            cfg.metrics_port,
        )
        log.info("configuration: %s", describe(cfg))
        if cfg.site_id:
            _say_what_site_id_does(cfg)
        await self._restore_quota(router, store)
        background.start(self._chores(router, store))
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(
            signal.SIGHUP, lambda: background.spawn(self._reload(router, "sighup"))
        )
        await stop.wait()
        await self._shutdown(router, store, auth_server, listening, background)
        return 0

    # -- pieces of serve ------------------------------------------------------------------------

    async def _open_store(self) -> SqliteHistory | None:
        cfg = self.config
        store_dir = Path(cfg.disk_db_path)
        store = SqliteHistory(store_dir, cfg.disk_db_ttl, self.clock.wall)
        try:
            # Locked before anything is deleted: a reset never removes the database another
            # router has open.
            await store.open(reset=cfg.reset_disk_db)
        except StoreInUse as exc:
            log.error("%s: give each router process its own --disk-db-path", exc)
            await store.close()
            return None
        except (OSError, sqlite3.Error) as exc:
            log.error("cannot open the persistent store in %s: %s", store_dir, exc)
            await store.close()
            return None
        if cfg.reset_disk_db:
            log.warning("--reset-disk-db: deleted the history database in %s", store_dir)
        return store

    @staticmethod
    def _removed(router: Router, background: _Background, record: AgentRecord) -> None:
        router.sessions.revoke_peer(record.peer_id)
        background.spawn(router.keeper.flush([record]))
        if record.link is not None:
            background.spawn(record.link.close("agent removed"))

    async def _reload(self, router: Router, trigger: str) -> dict[str, bool]:
        # Files are read off the event loop; each swap itself is one assignment.
        if trigger == "sighup":
            log.info("SIGHUP: reloading policies and auth, reopening the audit log")
            for writer in router.writers.values():
                writer.reopen()
        policies = await asyncio.to_thread(self.policies.reload)
        router.metrics.policy_reload.inc((trigger, "success" if policies else "error"))
        auth = await asyncio.to_thread(self.auth.reload)
        client = self.auth.client
        if auth and isinstance(client, StaticKeys):
            # Keys share their owner's quota: the tenants' ceiling gauges follow the file
            # now (a dynamic registry's keys change through the admin API, not here).
            router.metrics.tenants.reloaded({key.owner: key.quota for key in client.keys})
        return {"policies": policies, "auth": auth}

    def _guards(self) -> dict[str, ConnectionGuard]:
        """Every listening port's caps, fitted into the process's descriptor limit."""
        cfg = self.config
        open_files = raise_open_files_limit()
        wanted = {
            "client API": PortCaps(cfg.http_max_conns_per_ip, cfg.http_max_conns),
            "agent links": PortCaps(cfg.p2p_max_conns_per_ip, cfg.p2p_max_conns),
            "agent port before a session": PortCaps(cfg.p2p_max_conns_per_ip, cfg.p2p_max_pending),
            # Each relayed connection holds its socket and both ends of the loopback hop.
            "agent authentication": PortCaps(cfg.grpc_max_conns_per_ip, cfg.grpc_max_conns, 3),
            "metrics": PortCaps(cfg.metrics_max_conns_per_ip, cfg.metrics_max_conns),
        }
        caps, reserve = share_descriptors(open_files, wanted)
        if caps != wanted:
            log.warning(
                "open-files limit %d (%d kept for stores, files and children): connection "
                "caps lowered to fit: %s",
                open_files,
                reserve,
                "; ".join(
                    f"{name} {c.total} in all, {c.per_source} per address"
                    for name, c in caps.items()
                    if c != wanted[name]
                ),
            )
        guards = {name: ConnectionGuard(name, c.per_source, c.total) for name, c in caps.items()}
        # Links hold a valid session: an address's share of them is not lowered with the
        # limit, so agents behind one NAT keep their links at any limit.
        guards["agent links"].per_source = min(cfg.p2p_max_conns_per_ip, caps["agent links"].total)
        return guards

    async def _listen(
        self, router: Router, auth_server: GrpcAuthServer, guards: dict[str, ConnectionGuard]
    ) -> _Listening | None:
        """Start every listener, the public port last; None (logged) if one cannot bind.

        The public port opens last so that an answer from `/health` (what a load balancer,
        an orchestrator's readiness probe or a test waits for) means that the agents' gRPC
        and link ports and the metrics port are already accepting connections.
        """
        cfg = self.config
        runners: list[web.AppRunner] = []
        public = HttpServer(
            router.public_app,
            Limits(
                body=cfg.body_limit,
                head=MAX_HEADER_BYTES,
                idle=cfg.http_idle_timeout,
                write_idle=cfg.stream_write_timeout,
            ),
            error_page=_server_error_page,
            guard=guards["client API"],
            refusal=TOO_MANY_CONNECTIONS,
            malformed=QuietServerLog("hivenet.http").malformed,
        )
        flag = "--grpc-port"  # which listener failed, for the message
        try:
            await auth_server.start(cfg.grpc_port.host, cfg.grpc_port.port)
            flag = "--p2p-port"
            link = await start_site(
                router.control.link_app(),
                cfg.p2p_listen_addr,
                cfg.p2p_port,
                ssl_context=self.tls.server_context(),
                guard=guards["agent port before a session"],
                idle_timeout=cfg.p2p_handshake_timeout,
                handshake_timeout=cfg.p2p_handshake_timeout,
            )
            runners.append(link)
            gate = gate_of(link)
            if gate is not None:
                router.control.admit_link = _promotion(gate, guards["agent links"])
            flag = "--metrics-port"
            runners.append(
                await start_site(
                    _metrics_app(router),
                    cfg.metrics_port.host,
                    cfg.metrics_port.port,
                    guard=guards["metrics"],
                    refusal=METRICS_REFUSAL,
                )
            )
            flag = "--http-port"
            await public.listen(cfg.http_port.host, cfg.http_port.port, reuse_port=cfg.reuse_port)
        except (OSError, RuntimeError) as exc:
            log.error("cannot listen (%s): %s", flag, exc)
            await auth_server.stop()
            await public.close()
            for runner in runners:
                await runner.cleanup()
            return None
        return _Listening(public, runners)

    async def _restore_quota(self, router: Router, store: SqliteHistory) -> None:
        if self.config.quota_backend == "badger":
            day, _ = router.daily.today()
            try:
                router.daily.restore(day, await store.load_tokens(day))
            except sqlite3.Error as exc:
                router.metrics.quota_errors.inc(())
                log.error("cannot restore daily token totals: %s", exc)

    async def _save_quota(self, router: Router, store: SqliteHistory) -> None:
        if self.config.quota_backend == "badger":
            day, totals = router.daily.today()
            try:
                await store.save_tokens(day, totals)
            except sqlite3.Error as exc:
                router.metrics.quota_errors.inc(())
                log.error("cannot save daily token totals: %s", exc)

    def _chores(self, router: Router, store: SqliteHistory) -> list[Coroutine[Any, Any, None]]:
        """The periodic work: health sweeps, history flushes, quota saves, idle sweeps."""
        cfg = self.config

        async def every(seconds: float, action: Callable[[], Awaitable[None] | None]) -> None:
            while True:
                await asyncio.sleep(seconds)
                pending = action()
                if pending is not None:
                    await pending

        site = [router.site.run()] if router.site is not None else []
        ledger = [router.ledger.run()] if router.ledger is not None else []
        return [
            *site,
            *ledger,
            every(cfg.health_check_interval, router.monitor.sweep),
            every(cfg.universal_flush_interval, router.keeper.flush),
            every(cfg.universal_flush_interval, lambda: self._save_quota(router, store)),
            every(SWEEP_INTERVAL, router.admission.sweep),
        ]

    async def _shutdown(
        self,
        router: Router,
        store: SqliteHistory,
        auth_server: GrpcAuthServer,
        listening: _Listening,
        background: _Background,
    ) -> None:
        grace = self.config.shutdown_grace
        log.info(
            "shutting down: no new requests; %d in flight get up to %gs",
            len(router.edge.inflight),
            grace,
        )
        # The public port closes first, while agent connections still carry what is in
        # flight; only then do the agents hear that the router is going away.
        listening.public.stop_listening()
        router.admin.feed.close()  # registration streams never finish by themselves
        cut = await router.edge.drain(grace, lambda: setattr(router.relay, "stopping", True))
        if cut:
            log.warning("shutdown grace over: cut %d request(s) still in flight", cut)
        await listening.public.close()
        await router.bodies.close()
        await background.stop()
        if router.cache is not None:
            await router.cache.close()  # its engine calls and site locks, before the site
        if router.site is not None:
            await router.site.leave()  # hands its credits back to the site
        if router.ledger is not None:
            await router.ledger.close()  # what is still unbilled stays on disk
        if router.responses is not None:
            await router.responses.close()
        await router.keeper.flush()
        await self._save_quota(router, store)
        await store.close()
        for link in list(router.control.links):
            await link.close("router shutting down")
        await auth_server.stop()
        await self.providers.close()
        for runner in listening.others:
            await runner.cleanup()
        for writer in router.writers.values():
            await asyncio.to_thread(writer.close)
        if router.tracing is not None:
            await asyncio.to_thread(router.tracing.close)  # sends what is left, bounded


def _unpriced(config: RouterConfig, policies: PolicySet) -> str | None:
    """With wallets on, every model a policy serves needs a price: refused at start and on
    reload rather than found by the first client of that model."""
    if not config.ledger_dsn:
        return None
    missing = missing_prices([policies.default, *policies.named.values()])
    if not missing:
        return None
    return (
        "--ledger-dsn bills every request, but these policies serve models without a price "
        f"(add a prices block): {'; '.join(missing)}"
    )


@dataclass(frozen=True, slots=True)
class _Listening:
    public: HttpServer  # the client API
    others: list[web.AppRunner]  # the agent link and the metrics page


def _promotion(gate: TlsGate, links: ConnectionGuard) -> Callable[[tuple[object, ...] | None], int]:
    """An agent connection that showed a valid session moves to the links' guard: 0 when it
    did, 429 when its address holds its share of links, 503 when all are taken."""

    def promote(peer: tuple[object, ...] | None) -> int:
        if gate.promote(peer, links):
            return 0
        source = address_prefix(str(peer[0])) if peer else "unknown"
        return 429 if links.from_source(source) >= links.per_source else 503

    return promote


def _server_error_page(status: int, message: str) -> bytes:
    """The body of the answers the public server gives itself, in the usual envelope."""
    code = ErrorCode.REQUEST_TOO_LARGE if status in (413, 431) else ErrorCode.REQUEST_INVALID
    if status >= 500:
        code = ErrorCode.BACKEND_ERROR
    return error_body(code, message, status=status)


def _metrics_app(router: Router) -> web.Application:
    async def metrics_page(request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(router.metrics.registry),
            headers={"Content-Type": CONTENT_TYPE_LATEST},
        )

    app = web.Application()
    app.router.add_get("/metrics", metrics_page)
    return app


class _Background:
    """Tasks the process runs beside its listeners; all cancelled at shutdown."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()

    def spawn(self, coro: Coroutine[Any, Any, object]) -> None:
        task: asyncio.Task[Any] = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def start(self, coros: list[Coroutine[Any, Any, None]]) -> None:
        for coro in coros:
            self.spawn(coro)

    async def stop(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task


def _say_what_site_id_does(cfg: RouterConfig) -> None:
    """--site-id comes from the Go router, where it also turns on cross-site redirect."""
    if cfg.sync_site and cfg.sync_site != cfg.site_id:
        log.warning(
            "--site-id %s is ignored: --sync-site %s names the site (this router does no "
            "cross-site redirect)",
            cfg.site_id,
            cfg.sync_site,
        )
    elif cfg.sync_store:
        log.info(
            "--site-id %s names the site in the sync store; this router does no cross-site "
            "redirect",
            cfg.site_id,
        )
    else:
        log.info(
            "--site-id %s has no effect without --sync-store: this router does no "
            "cross-site redirect",
            cfg.site_id,
        )


async def _open_responses(router: Router) -> bool:
    """Open the stored responses' database; False (logged) when it cannot be."""
    if router.responses is None:
        return True
    try:
        await router.responses.open()
    except (OSError, sqlite3.Error) as exc:
        log.error("cannot open the stored responses' database: %s", exc)
        await router.responses.close()
        return False
    return True
