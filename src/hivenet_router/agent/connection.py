"""One router's session: authenticate, open the data connection, register, then heartbeats,
routing signals and renewals, and after any end or failure start again. The engine, its
monitor and the backend proxy are shared by the sessions of every router (agent/routers.py
runs one of these per router)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

import msgspec
import orjson

from hivenet_router.agent.cache_picture import REPORT_GAP, reports
from hivenet_router.agent.discovery import Listed, Verdict, parse_routers
from hivenet_router.agent.monitor import BackendMonitor, Pulse, signal_key
from hivenet_router.agent.proxy import BackendProxy
from hivenet_router.agent.session import CALL_TIMEOUT, RouterAuth, RouterRejected, Session
from hivenet_router.config.agent import AgentConfig
from hivenet_router.config.values import ListenAddress
from hivenet_router.domain.agent import Heartbeat, Registration, Renewal, RoutingSignal
from hivenet_router.transport import frames, websocket
from hivenet_router.transport.identity import Identity
from hivenet_router.transport.link import INFERENCE_PROTOCOL, ROUTER_PROTOCOL, Link, StreamReset

log = logging.getLogger("hivenet.agent")

RECONNECT_JITTER = 0.2
# Early heartbeats (backend health or the agent's fullness flipped) are this far apart at
# least, so a load hovering at capacity does not turn into a heartbeat per request.
MIN_BEAT_GAP = 0.1
# A routing-signal loop with no new sample wakes this often all the same (a safety net).
SIGNAL_WAKE = 30.0


def reconnect_wait(delay: float) -> float:
    """The wait before the next connection attempt: `--reconnect-delay` (5 s) give or take
    20%, the same after every failure. It does not grow: a router back from a restart gets
    its agents back within seconds, and the jitter keeps a fleet that lost it together from
    dialling in step."""
    return delay * random.uniform(1 - RECONNECT_JITTER, 1 + RECONNECT_JITTER)


@dataclass(frozen=True, slots=True)
class Serving:
    """What every router's session shares: one engine, watched and proxied once."""

    config: AgentConfig
    identity: Identity
    tls: ssl.SSLContext  # the data connection's, pinned to the site's router key
    model: str
    monitor: BackendMonitor
    proxy: BackendProxy
    beats: Pulse


class Site(Protocol):
    """The session manager, as one session sees it."""

    def address(self, entry_id: int) -> ListenAddress | None:
        """Where to dial next; None once the entry is closed."""
        ...

    def reached(self, entry_id: int, session: Session) -> Verdict: ...

    def listed(self, routers: list[Listed]) -> None: ...

    def released(self, entry_id: int) -> None:
        """The session that got GO is down."""
        ...

    def several(self) -> bool:
        """Is the agent registered with more than one router?"""
        ...

    def routers_up(self) -> list[str]:
        """The router IDs of the sessions that are up."""
        ...


STANDBY = "reached through another --routers entry"
_LEVELS = {"refusing this agent": logging.ERROR, STANDBY: logging.INFO}


class Outage:
    """One log line when a router stops answering (or refuses), one when it is back."""

    def __init__(self, name: Callable[[], str]) -> None:
        self._name = name
        self._kind = ""
        self._attempts = 0

    def failed(self, kind: str, detail: str, wait: float) -> None:
        self._attempts += 1
        if kind == self._kind:
            log.debug("router %s still %s (%s)", self._name(), kind, detail)
            return
        self._kind = kind
        level = _LEVELS.get(kind, logging.WARNING)
        log.log(
            level,
            "router %s %s (%s); retrying every %.1fs or so, logged again once it answers",
            self._name(),
            kind,
            detail,
            wait,
        )

    def ended(self, wait: float, why: str) -> None:
        self._kind, self._attempts = "disconnected", 0
        log.warning(
            "connection to router %s ended: %s; reconnecting in %.1fs", self._name(), why, wait
        )

    def recovered(self) -> None:
        if self._attempts:
            log.info("router %s answers again after %d attempts", self._name(), self._attempts)
        self._kind, self._attempts = "", 0


class RouterConnection:
    """The session with one router (one entry of the manager), forever or until closed."""

    def __init__(
        self,
        entry_id: int,
        site: Site,
        serving: Serving,
        dial: Callable[[ListenAddress], RouterAuth],
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.entry_id = entry_id
        self.site = site
        self.serving = serving
        self._dial = dial
        self._sleep = sleep
        self._auth: tuple[ListenAddress, RouterAuth] | None = None
        self._addr: ListenAddress | None = None
        self._router_id = ""
        self._outage = Outage(lambda: self.name)

    @property
    def name(self) -> str:
        """The router as logs name it: its router ID (once known) and address."""
        return f"{self._router_id} ({self._addr})" if self._router_id else str(self._addr)

    def _auth_for(self, addr: ListenAddress) -> RouterAuth:
        if self._auth is None or self._auth[0] != addr:
            self._auth = (addr, self._dial(addr))
        return self._auth[1]

    async def run(self) -> None:
        """Connect, register and serve; after any end or failure wait `reconnect_wait` and
        start again. Returns when the manager closes the entry."""
        while (addr := self.site.address(self.entry_id)) is not None:
            wait = reconnect_wait(self.serving.config.reconnect_delay)
            self._addr = addr
            try:
                auth = self._auth_for(addr)
                session = await auth.authenticate()
                self._router_id = session.router_id
                verdict = self.site.reached(self.entry_id, session)
                self.site.listed(list(session.routers))
                if verdict is Verdict.CLOSE:
                    log.info("router %s is reached through another session already", self.name)
                    return
                if verdict is Verdict.STANDBY:
                    self._outage.failed(STANDBY, "standing by", wait)
                else:
                    self._outage.ended(wait, await self._hold(auth, session))
            except RouterRejected as exc:
                self._outage.failed("refusing this agent", str(exc), wait)
            except (TimeoutError, StreamReset, OSError) as exc:
                # ConnectionError (an OSError) covers an unreachable router and a
                # refused WebSocket handshake.
                self._outage.failed("unreachable", str(exc) or type(exc).__name__, wait)
            except Exception:  # a fault in one router's session must not end the others
                log.exception("session with router %s failed; retrying in %.1fs", self.name, wait)
            await self._sleep(wait)

    async def _hold(self, auth: RouterAuth, session: Session) -> str:
        """Serve the router until the connection ends; why it ended."""
        try:
            return await self._run_link(auth, session)
        finally:
            self.site.released(self.entry_id)

    def _registration(self, session: Session) -> bytes:
        cfg = self.serving.config
        reg = Registration(
            peer_id=self.serving.identity.peer_id,
            model=self.serving.model,
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
            backend_healthy=self.serving.monitor.healthy,
            signature=session.proof(self.serving.identity),
        )
        return msgspec.json.encode(reg)

    async def _run_link(self, auth: RouterAuth, session: Session) -> str:
        serving = self.serving
        ws = await websocket.connect(
            session.link_url,
            ssl_context=serving.tls,
            headers={"Authorization": f"Bearer {session.token}"},
            heartbeat=5.0,
            max_size=frames.MAX_FRAME,
        )
        link = Link(
            ws,
            dialer=True,
            handlers={INFERENCE_PROTOCOL: serving.proxy.handle},
            name=f"router {self.name}",
        )
        reader = asyncio.create_task(link.run())
        try:
            status, reply = await link.call(
                ROUTER_PROTOCOL, "/register", self._registration(session), CALL_TIMEOUT
            )
            if status != 200:
                raise RouterRejected(
                    f"registration refused: {reply[:200].decode(errors='replace')}"
                )
            self._outage.recovered()
            log.info("registered with router %s as %s", self.name, serving.identity.peer_id)
            async with asyncio.TaskGroup() as group:
                tasks = [
                    group.create_task(self._heartbeats(link, session.heartbeat_interval)),
                    group.create_task(self._signals(link)),
                    group.create_task(self._renewals(link, auth, session)),
                    group.create_task(self._cache_reports(link)),
                ]
                await link.wait_closed()
                for task in tasks:
                    task.cancel()
            return link.close_reason
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
        identity = self.serving.identity
        while not link.closed:
            await asyncio.sleep(max(session.renew_at - loop.time(), 0.0))
            try:
                fresh = await auth.authenticate()
                body = msgspec.json.encode(
                    Renewal(session_token=fresh.token, signature=fresh.proof(identity))
                )
                status, reply = await link.call(ROUTER_PROTOCOL, "/renew", body, CALL_TIMEOUT)
                if status != 200:
                    raise RouterRejected(reply[:200].decode(errors="replace"))
            except (RouterRejected, TimeoutError, StreamReset, OSError) as exc:
                retry = self.serving.config.session_retry_interval
                log.warning(
                    "session renewal with router %s failed (%s); retrying in %.0fs",
                    self.name,
                    exc,
                    retry,
                )
                await asyncio.sleep(retry)
                continue
            session = fresh
            log.info("session with router %s renewed", self.name)

    def _beat(self) -> bytes:
        serving = self.serving
        proxy, monitor = serving.proxy, serving.monitor
        return msgspec.json.encode(
            Heartbeat(
                backend_healthy=monitor.healthy,
                active_requests=proxy.active,
                # Alone with one router, that router's own count is exact and a report
                # could only be staler.
                inflight_total=proxy.active if self.site.several() else None,
                routers_up=self.site.routers_up(),
                engine=monitor.engine,
                hardware=monitor.hardware,
                histograms=monitor.histograms(),
                stopping=proxy.stopping,
            )
        )

    async def _heartbeats(self, link: Link, interval: float) -> None:
        beats = self.serving.beats
        loop = asyncio.get_running_loop()
        while not link.closed:
            seen, sent = beats.version, loop.time()
            try:
                status, reply = await link.call(
                    ROUTER_PROTOCOL, "/heartbeat", self._beat(), CALL_TIMEOUT
                )
            except (StreamReset, TimeoutError) as exc:
                log.warning("heartbeat to router %s failed (%s); reconnecting", self.name, exc)
                await link.close("heartbeat failed")
                return
            if status != 200:
                log.warning(
                    "router %s rejected a heartbeat (HTTP %d); re-registering", self.name, status
                )
                await link.close("heartbeat rejected")
                return
            self.site.listed(_routers_of(reply))
            # Wake early when backend health or the agent's fullness flips, so the routers
            # learn at once.
            if await beats.wait(seen, max(sent + interval - loop.time(), 0.0)):
                await asyncio.sleep(max(sent + MIN_BEAT_GAP - loop.time(), 0.0))

    async def _signals(self, link: Link) -> None:
        """A signal when a new sample changed what routing reads, at most one per
        --routing-signal-interval. Between samples nothing runs (an idle agent samples
        every few seconds, so this wakes as rarely)."""
        monitor = self.serving.monitor
        interval = self.serving.config.routing_signal_interval
        sent: object = None
        seen = -1  # whatever was sampled before the link opened goes out at once
        while not link.closed:
            if not await monitor.sampled.wait(seen, SIGNAL_WAKE):
                continue
            seen = monitor.sampled.version
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
            await asyncio.sleep(interval)

    async def _cache_reports(self, link: Link) -> None:
        """The engine's cache picture (agent/cache_picture.py): the whole of it first, so a
        router that starts late or reconnects has it, then what changed, at most one
        report per REPORT_GAP. A report that fails is followed by the whole picture again;
        a router that does not know the call (an older one) is sent nothing more."""
        picture = self.serving.proxy.picture
        if picture is None:
            return
        position = -1
        while not link.closed:
            seen = picture.changed.version
            full, changes, end = picture.since(position)
            for report in reports(full, changes):
                try:
                    status, _ = await link.call(
                        ROUTER_PROTOCOL,
                        "/cache-blocks",
                        msgspec.json.encode(report),
                        CALL_TIMEOUT,
                    )
                except (StreamReset, TimeoutError):
                    status = 0
                if status == 404:
                    return
                if status != 200:
                    end = -1
                    break
            position = end
            await asyncio.sleep(REPORT_GAP)
            await picture.changed.wait(seen, SIGNAL_WAKE)


def _routers_of(reply: bytes) -> list[Listed]:
    """The site's routers in a heartbeat reply; none from a router that sends none."""
    try:
        body = orjson.loads(reply)
    except orjson.JSONDecodeError:
        return []
    return parse_routers(body.get("routers")) if isinstance(body, dict) else []
