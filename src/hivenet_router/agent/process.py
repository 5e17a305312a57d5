"""The agent's lifecycle: identity, backend readiness, then a session with every router of
the site (agent/routers.py), each reconnecting after any failure. The agent never exits
because the backend or a router is down."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path

from hivenet_router.agent.cache_picture import CachePicture
from hivenet_router.agent.connection import Serving
from hivenet_router.agent.engines import adapter_for
from hivenet_router.agent.hardware import HardwareSampler, read_device_file
from hivenet_router.agent.kv_events import follow_forever
from hivenet_router.agent.monitor import BackendMonitor, Pulse
from hivenet_router.agent.proxy import BackendProxy
from hivenet_router.agent.routers import Routers
from hivenet_router.agent.session import GrpcRouterAuth, RouterAuth
from hivenet_router.config.agent import AgentConfig, kv_events_address, load_backend_api_key
from hivenet_router.config.options import ConfigError
from hivenet_router.config.values import ListenAddress
from hivenet_router.http1.client import EngineClient
from hivenet_router.observability.spans import AgentTracing
from hivenet_router.observability.spans import configured as tracing_configured
from hivenet_router.transport import trust, wsmask
from hivenet_router.transport.identity import Identity, IdentityError, load_or_create
from hivenet_router.transport.tls import GRPC_ALPN, RouterTlsIdentity

log = logging.getLogger("hivenet.agent")
FINISH_POLL = 0.05  # how often a shutdown looks whether what was in flight has finished


class AgentProcess:
    def __init__(
        self,
        config: AgentConfig,
        secret: bytes,
        identity: Identity,
        sampler: HardwareSampler,
        *,
        backend_api_key: str = "",
        dial: Callable[[ListenAddress], RouterAuth] | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.sampler = sampler
        self.config = config
        self.secret = secret
        self.identity = identity
        self.tls = RouterTlsIdentity.from_secret(secret)
        self._client_tls = self.tls.client_context()  # the link (WebSocket over HTTP/1.1)
        self._auth_tls = self.tls.client_context(GRPC_ALPN)  # the Authenticate call (gRPC, HTTP/2)
        # Sent on every request to the engine; never logged.
        self._backend_auth = (
            [("Authorization", f"Bearer {backend_api_key}")] if backend_api_key else []
        )
        self.dial = dial or self._grpc_auth
        self._sleep = sleep

    def _grpc_auth(self, router: ListenAddress) -> RouterAuth:
        return GrpcRouterAuth(
            router, self.secret, self.identity, self.config.capacity, self._auth_tls
        )

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
        # The router reloads on SIGHUP, so an operator may send it to both: the agent has
        # nothing to reload, and the signal's default would end it without a word.
        with contextlib.suppress(NotImplementedError, RuntimeError):
            asyncio.get_running_loop().add_signal_handler(
                signal.SIGHUP,
                lambda: log.info("SIGHUP: the agent has nothing to reload; ignored"),
            )
        if not wsmask.COMPILED:
            log.warning(
                "aiohttp's compiled WebSocket mask is not in use (missing, failed its check, "
                "or AIOHTTP_NO_EXTENSIONS is set): the link masks every frame in pure Python, "
                "ten to fifty times slower"
            )
        # Keep as many connections as requests may run at once, so a busy agent does not
        # open a new connection per request once past a fixed idle limit.
        backend = EngineClient(cfg.backend_url, max_idle=min(cfg.capacity, 1024))
        tracing = AgentTracing(os.environ) if tracing_configured(os.environ) else None
        beats = Pulse()
        monitor = BackendMonitor(
            backend,
            adapter_for(cfg.engine),
            cfg.health_url,
            busy=lambda: proxy.active > 0,
            auth=self._backend_auth,
        )
        # One proxy for every router: it counts the agent's requests from all of them and
        # holds the engine to --capacity; each time the agent turns full or free, every
        # router hears it with an early heartbeat. Taking work while idle wakes the sampling.
        # The prefix blocks its engine holds, sized by the engine's reported cache.
        picture = CachePicture(
            lambda: monitor.engine.kv_cache_tokens if monitor.engine is not None else None
        )
        monitor.on_down = picture.clear
        proxy = BackendProxy(
            backend,
            cfg.http_timeout,
            cfg.stream_write_timeout,
            auth=self._backend_auth,
            tracing=tracing,
            capacity=cfg.capacity,
            on_turn=beats.notify,
            on_busy=monitor.wake,
            picture=picture,
        )
        try:
            main = asyncio.create_task(self._main(monitor, proxy, beats))
            stopper = asyncio.create_task(stop.wait())
            await asyncio.wait({main, stopper}, return_when=asyncio.FIRST_COMPLETED)
            if not main.done():
                await self._let_finish(proxy, beats, main)
            for task in (main, stopper):
                task.cancel()
            # Wait for it to wind down without raising what it failed with: that is said
            # below in one line (a backend not ready in time ended in a traceback).
            await asyncio.wait({main})
            if not main.cancelled() and main.exception() is not None:
                log.error("agent stopped: %s", main.exception())
                return 1
        finally:
            await monitor.close()
            await backend.close()
            if tracing is not None:
                await asyncio.to_thread(tracing.close)
        log.info("agent stopped")
        return 0

    async def _let_finish(
        self, proxy: BackendProxy, beats: Pulse, main: asyncio.Task[None]
    ) -> None:
        """SIGTERM with requests in flight: tell every router (an early heartbeat) to send
        nothing new, and give what is in flight up to --shutdown-grace to finish."""
        grace = self.config.shutdown_grace
        if proxy.active == 0 or grace <= 0:
            return
        log.info(
            "shutting down: the routers send nothing new; %d request(s) in flight get up to %gs",
            proxy.active,
            grace,
        )
        proxy.stopping = True
        beats.notify()
        deadline = asyncio.get_running_loop().time() + grace
        while proxy.active and not main.done():
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                log.warning(
                    "shutdown grace over: cutting %d request(s) still in flight", proxy.active
                )
                return
            await asyncio.sleep(min(FINISH_POLL, left))
        log.info("requests in flight finished")

    async def _main(self, monitor: BackendMonitor, proxy: BackendProxy, beats: Pulse) -> None:
        cfg = self.config
        await monitor.wait_ready(1.0, cfg.backend_ready_timeout)
        model = cfg.model or await monitor.discover_model(2.0)
        log.info(
            "serving model %s (%s, capability %s, capacity %d) to %s",
            model,
            cfg.engine,
            cfg.capability,
            cfg.capacity,
            ", ".join(str(address) for address in cfg.router_addresses),
        )
        serving = Serving(
            config=cfg,
            identity=self.identity,
            tls=self._client_tls,
            model=model,
            monitor=monitor,
            proxy=proxy,
            beats=beats,
        )
        routers = Routers(serving, self.dial, sleep=self._sleep)
        async with asyncio.TaskGroup() as group:
            group.create_task(monitor.check_health_forever(cfg.backend_check_interval))
            group.create_task(monitor.sample_engine_forever(cfg.engine_sample_interval))
            group.create_task(
                monitor.sample_hardware_forever(self.sampler, cfg.hardware_sample_interval)
            )
            group.create_task(routers.run())
            if cfg.kv_events_endpoint and proxy.picture is not None:
                host, port = kv_events_address(cfg.kv_events_endpoint)
                group.create_task(follow_forever(proxy.picture, host, port, cfg.kv_events_topic))
