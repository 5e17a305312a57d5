"""The agent's lifecycle: identity, backend readiness, then connect, register and serve,
reconnecting after any failure. The agent never exits because the backend or the router is
down."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec

from hivenet_router.agent.engines import adapter_for
from hivenet_router.agent.hardware import HardwareSampler, read_device_file
from hivenet_router.agent.monitor import BackendMonitor, signal_key
from hivenet_router.agent.proxy import BackendProxy
from hivenet_router.agent.session import (
    CALL_TIMEOUT,
    GrpcRouterAuth,
    RouterAuth,
    RouterRejected,
    Session,
)
from hivenet_router.config.agent import AgentConfig, load_backend_api_key
from hivenet_router.config.options import ConfigError
from hivenet_router.domain.agent import Heartbeat, Registration, Renewal, RoutingSignal
from hivenet_router.http1.client import EngineClient
from hivenet_router.observability.tracing import AgentTracing
from hivenet_router.observability.tracing import configured as tracing_configured
from hivenet_router.transport import frames, trust, websocket
from hivenet_router.transport.identity import Identity, IdentityError, load_or_create
from hivenet_router.transport.link import (
    INFERENCE_PROTOCOL,
    ROUTER_PROTOCOL,
    Link,
    StreamReset,
)
from hivenet_router.transport.tls import RouterTlsIdentity

log = logging.getLogger("hivenet.agent")

RECONNECT_JITTER = 0.2


def reconnect_wait(delay: float) -> float:
    """The wait before the next connection attempt: `--reconnect-delay` (5 s) give or take
    20%, the same after every failure. It does not grow: a router back from a restart gets
    its agents back within seconds, and the jitter keeps a fleet that lost it together from
    dialling in step."""
    return delay * random.uniform(1 - RECONNECT_JITTER, 1 + RECONNECT_JITTER)


class AgentProcess:
    def __init__(
        self,
        config: AgentConfig,
        secret: bytes,
        identity: Identity,
        sampler: HardwareSampler,
        *,
        backend_api_key: str = "",
        auth: RouterAuth | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.sampler = sampler
        self.config = config
        self.secret = secret
        self.identity = identity
        self.tls = RouterTlsIdentity.from_secret(secret)
        # Sent on every request to the engine; never logged.
        self._backend_auth = (
            [("Authorization", f"Bearer {backend_api_key}")] if backend_api_key else []
        )
        self.auth = auth or GrpcRouterAuth(config.router_grpc, secret, identity, config.capacity)
        self._sleep = sleep

    @classmethod
    def build(cls, config: AgentConfig) -> AgentProcess:
        try:
            secret = trust.load_secret(config.jwt_secret_file, config.jwt_secret)
        except trust.TrustError as exc:
            raise ConfigError(str(exc)) from None
        try:
            identity, created = load_or_create(Path(config.identity_path))
        except (IdentityError, OSError) as exc:
            raise ConfigError(f"--identity-path: {exc}") from None
        log.info(
            "agent peer ID %s (%s %s)",
            identity.peer_id,
            "created" if created else "loaded",
            config.identity_path,
        )
        try:
            devices = read_device_file(config.gpu_devices_file)
        except OSError as exc:
            raise ConfigError(f"--gpu-devices-file: {exc.strerror}") from None
        backend_api_key = load_backend_api_key(config)
        return cls(
            config, secret, identity, HardwareSampler(devices), backend_api_key=backend_api_key
        )

    async def serve(self, stop: asyncio.Event) -> int:
        cfg = self.config
        # Keep as many connections as requests may run at once, so a busy agent does not
        # open a new connection per request once past a fixed idle limit.
        backend = EngineClient(cfg.backend_url, max_idle=min(cfg.capacity, 1024))
        tracing = AgentTracing(os.environ) if tracing_configured(os.environ) else None
        proxy = BackendProxy(
            backend,
            cfg.http_timeout,
            cfg.stream_write_timeout,
            auth=self._backend_auth,
            tracing=tracing,
        )
        monitor = BackendMonitor(
            backend,
            adapter_for(cfg.engine),
            cfg.health_url,
            busy=lambda: proxy.active > 0,
            auth=self._backend_auth,
        )
        try:
            main = asyncio.create_task(self._main(monitor, proxy))
            stopper = asyncio.create_task(stop.wait())
            await asyncio.wait({main, stopper}, return_when=asyncio.FIRST_COMPLETED)
            for task in (main, stopper):
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await main
            if main.done() and not main.cancelled() and main.exception() is not None:
                log.error("agent stopped: %s", main.exception())
                return 1
        finally:
            await monitor.close()
            await backend.close()
            if tracing is not None:
                await asyncio.to_thread(tracing.close)
        log.info("agent stopped")
        return 0

    async def _main(self, monitor: BackendMonitor, proxy: BackendProxy) -> None:
        cfg = self.config
        await monitor.wait_ready(1.0, cfg.backend_ready_timeout)
        model = cfg.model or await monitor.discover_model(2.0)
        log.info(
            "serving model %s (%s, capability %s, capacity %d)",
            model,
            cfg.engine,
            cfg.capability,
            cfg.capacity,
        )
        async with asyncio.TaskGroup() as group:
            group.create_task(monitor.check_health_forever(cfg.backend_check_interval))
            group.create_task(monitor.sample_engine_forever(cfg.engine_sample_interval))
            group.create_task(
                monitor.sample_hardware_forever(self.sampler, cfg.hardware_sample_interval)
            )
            group.create_task(self.connect_forever(model, monitor, proxy))

    async def connect_forever(
        self, model: str, monitor: BackendMonitor, proxy: BackendProxy
    ) -> None:
        """Connect, register and serve; after any end or failure wait `reconnect_wait` and
        start again."""
        auth = self.auth
        while True:
            wait = reconnect_wait(self.config.reconnect_delay)
            try:
                session = await auth.authenticate()
                await self._run_link(auth, session, model, monitor, proxy)
                log.warning("connection to the router ended; reconnecting in %.1fs", wait)
            except RouterRejected as exc:
                log.error("router refused this agent: %s; retrying in %.1fs", exc, wait)
            except (TimeoutError, StreamReset, OSError) as exc:
                # ConnectionError (an OSError) covers an unreachable router and a
                # refused WebSocket handshake.
                log.warning(
                    "router unreachable (%s); retrying in %.1fs",
                    exc or type(exc).__name__,
                    wait,
                )
            await self._sleep(wait)

    def _registration(self, model: str, monitor: BackendMonitor, session: Session) -> bytes:
        cfg = self.config
        reg = Registration(
            peer_id=self.identity.peer_id,
            model=model,
            capability=cfg.capability,
            engine=cfg.engine,
            capacity=cfg.capacity,
            version=cfg.version,
            region=cfg.region,
            organization=cfg.organization,
            machine=cfg.machine,
            tags=list(cfg.tags),
            gpu_model=cfg.gpu_model,
            deployment_id=cfg.deployment_id,
            replica_id=cfg.replica_id,
            hide_llm=cfg.hide_llm,
            llm_pretty_name=cfg.llm_pretty_name,
            llm_info=cfg.llm_info,
            backend_healthy=monitor.healthy,
            signature=session.proof(self.identity),
        )
        return msgspec.json.encode(reg)

    async def _run_link(
        self,
        auth: RouterAuth,
        session: Session,
        model: str,
        monitor: BackendMonitor,
        proxy: BackendProxy,
    ) -> None:
        ws = await websocket.connect(
            session.link_url,
            ssl_context=self.tls.client_context(),
            headers={"Authorization": f"Bearer {session.token}"},
            heartbeat=5.0,
            max_size=frames.MAX_FRAME,
        )
        link = Link(ws, dialer=True, handlers={INFERENCE_PROTOCOL: proxy.handle}, name="router")
        reader = asyncio.create_task(link.run())
        try:
            registration = self._registration(model, monitor, session)
            status, reply = await link.call(
                ROUTER_PROTOCOL, "/register", registration, CALL_TIMEOUT
            )
            if status != 200:
                raise RouterRejected(
                    f"registration refused: {reply[:200].decode(errors='replace')}"
                )
            log.info(
                "registered with router %s as %s",
                session.router_peer_id or "?",
                self.identity.peer_id,
            )
            async with asyncio.TaskGroup() as group:
                tasks = [
                    group.create_task(
                        self._heartbeats(link, session.heartbeat_interval, monitor, proxy)
                    ),
                    group.create_task(self._signals(link, monitor)),
                    group.create_task(self._renewals(link, auth, session)),
                ]
                await link.wait_closed()
                for task in tasks:
                    task.cancel()
        finally:
            await link.close("agent reconnecting")
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader

    async def _renewals(self, link: Link, auth: RouterAuth, session: Session) -> None:
        """Renew the session before it expires, over the live connection, so in-flight
        requests never notice. A failed renewal is retried; if the session expires anyway
        the router refuses heartbeats and the agent reconnects."""
        loop = asyncio.get_running_loop()
        while not link.closed:
            await asyncio.sleep(max(session.renew_at - loop.time(), 0.0))
            try:
                fresh = await auth.authenticate()
                body = msgspec.json.encode(
                    Renewal(session_token=fresh.token, signature=fresh.proof(self.identity))
                )
                status, reply = await link.call(ROUTER_PROTOCOL, "/renew", body, CALL_TIMEOUT)
                if status != 200:
                    raise RouterRejected(reply[:200].decode(errors="replace"))
            except (RouterRejected, TimeoutError, StreamReset, OSError) as exc:
                retry = self.config.session_retry_interval
                log.warning("session renewal failed (%s); retrying in %.0fs", exc, retry)
                await asyncio.sleep(retry)
                continue
            session = fresh
            log.info("session renewed")

    async def _heartbeats(
        self, link: Link, interval: float, monitor: BackendMonitor, proxy: BackendProxy
    ) -> None:
        while not link.closed:
            beat = Heartbeat(
                backend_healthy=monitor.healthy,
                active_requests=proxy.active,
                engine=monitor.engine,
                hardware=monitor.hardware,
                histograms=monitor.histograms(),
            )
            try:
                status, _ = await link.call(
                    ROUTER_PROTOCOL, "/heartbeat", msgspec.json.encode(beat), CALL_TIMEOUT
                )
            except (StreamReset, TimeoutError) as exc:
                log.warning("heartbeat failed (%s); dropping the connection", exc)
                await link.close("heartbeat failed")
                return
            if status != 200:
                log.warning("router rejected a heartbeat (HTTP %d); re-registering", status)
                await link.close("heartbeat rejected")
                return
            monitor.changed.clear()
            # Wake early when backend health flips, so the router learns at once.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval):
                    await monitor.changed.wait()

    async def _signals(self, link: Link, monitor: BackendMonitor) -> None:
        interval = self.config.routing_signal_interval
        sent: object = None
        while not link.closed:
            await asyncio.sleep(interval)
            if monitor.engine is None and monitor.hardware is None:
                continue
            key = signal_key(monitor.engine, monitor.hardware)
            if key == sent:
                continue  # nothing routing would notice has changed
            signal = RoutingSignal(engine=monitor.engine, hardware=monitor.hardware)
            with contextlib.suppress(StreamReset, TimeoutError):
                await link.call(
                    ROUTER_PROTOCOL, "/routing-signals", msgspec.json.encode(signal), CALL_TIMEOUT
                )
                sent = key
