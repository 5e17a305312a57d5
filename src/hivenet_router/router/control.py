"""The agent connection and the management calls that travel on it.

The data connection (on --p2p-port, TLS with the router's pinned key) is a WebSocket
upgrade that must carry a live session token. Registration, renewal, heartbeats and routing
signals then travel as calls on the router protocol of that connection; none of them exists
on the public HTTP port. Each connection stays bound to one session at a time: management
calls on a connection whose session expired without renewal are refused, and the agent
reconnects.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import msgspec
import orjson
from aiohttp import web

from hivenet_router.clock import Clock
from hivenet_router.domain.agent import (
    CacheReport,
    Heartbeat,
    Registration,
    Renewal,
    RoutingSignal,
)
from hivenet_router.observability.events import AgentEvent, Observers
from hivenet_router.router.agent_auth import Sessions
from hivenet_router.router.history import HistoryKeeper
from hivenet_router.router.registry import AgentRecord, Registry
from hivenet_router.transport import frames, trust, ws_server
from hivenet_router.transport.link import ROUTER_PROTOCOL, Link, Stream

log = logging.getLogger("hivenet.auth")

LINK_PATH = "/hivenet/link"
MAX_CONTROL_BODY = 64 * 1024
REPLACED_WINDOW = 60.0  # seconds over which an agent's replaced connections are counted
REPLACED_SAID = 3  # replaced this often within the window: two processes, one identity
REPLACED_PEERS = 1024  # agents whose replacements are remembered at once
REFUSALS_SAID_EVERY = 60.0  # seconds between log lines on refused link upgrades
LINK_HEARTBEAT = 5.0  # seconds without a byte from the agent before the router pings it

_registration = msgspec.json.Decoder(Registration)
_renewal = msgspec.json.Decoder(Renewal)
_heartbeat = msgspec.json.Decoder(Heartbeat)
_signal = msgspec.json.Decoder(RoutingSignal)
_cache_report = msgspec.json.Decoder(CacheReport)


def _ignore_report(record: AgentRecord, report: CacheReport) -> None:
    pass


Reply = tuple[int, dict[str, object]]


@dataclass
class Binding:
    """One connection's current session, and the agent it registered."""

    link: Link
    grant: trust.SessionGrant
    record: AgentRecord | None = None
    fresh: bool = False  # the last registration was new to this router: restore history


class ControlPlane:
    def __init__(
        self,
        *,
        registry: Registry,
        observers: Observers,
        clock: Clock,
        sessions: Sessions,
        router_peer_id: str,
        history: HistoryKeeper,
        site_routers: Callable[[], list[dict[str, str]]] = list,
    ) -> None:
        # Discovery: the live routers of the site, in every heartbeat reply.
        self.site_routers = site_routers
        self.history = history
        self.registry = registry
        self.observers = observers
        self.clock = clock
        self.sessions = sessions
        self.router_peer_id = router_peer_id
        self.links: set[Link] = set()
        # When each agent's registrations replaced a connection still open (_replaced).
        self._replacements: dict[str, list[float]] = {}
        self._replaced_said: dict[str, float] = {}  # when that was last said, by agent
        # Upgrades refused for want of a session since the last line that said so: anyone
        # can send them (thousands a second on a few pipelined connections), so they are
        # summarised at most once a minute rather than logged one by one.
        self._refused = 0
        self._refused_said = -REFUSALS_SAID_EVERY
        # Moves a connection that showed a valid session out of the agent port's room for
        # those that have not (set by the process, which owns the listener). 0: done; else
        # the status to refuse it with (429: its address has its share, 503: all are taken).
        self.admit_link: Callable[[tuple[object, ...] | None], int] = lambda peer: 0
        self._closing: set[asyncio.Task[None]] = set()  # replaced links being closed
        # Where an agent's report of its engine's prefix cache goes (routing state's
        # prefix indexes; set by wiring).
        self.cache_report: Callable[[AgentRecord, CacheReport], None] = _ignore_report
        self._calls: dict[str, Callable[[Binding, bytes], Reply]] = {
            "/register": self._register,
            "/renew": self._renew,
            "/heartbeat": self._heartbeat,
            "/routing-signals": self._signal,
            "/cache-blocks": self._cache_blocks,
        }

    def _replaced(self, peer: str) -> None:
        """A registration took the place of a connection still open. An agent that
        reconnects does so once; two agent processes sharing one identity (a copied key
        file) do it to each other over and over, and nothing else says so."""
        now = self.clock.monotonic()
        times = [t for t in self._replacements.get(peer, ()) if now - t < REPLACED_WINDOW]
        times.append(now)
        if len(self._replacements) >= REPLACED_PEERS and peer not in self._replacements:
            self._replacements.clear()  # bounded: a flood of peers forgets, never grows
        self._replacements[peer] = times[-REPLACED_SAID:]
        said = self._replaced_said.get(peer)
        if len(times) >= REPLACED_SAID and (said is None or now - said >= REPLACED_WINDOW):
            # Once a window while it lasts.
            if len(self._replaced_said) >= REPLACED_PEERS:
                self._replaced_said.clear()
            self._replaced_said[peer] = now
            log.warning(
                "agent %s replaced its own open connection %d times in %.0f s: are two "
                "agent processes using one identity file (--identity-path)? Each new "
                "registration closes the other's connection",
                peer,
                REPLACED_SAID,
                REPLACED_WINDOW,
            )

    def link_app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_CONTROL_BODY)
        app.router.add_get(LINK_PATH, self.accept_link)
        return app

    async def accept_link(self, request: web.Request) -> web.StreamResponse:
        auth = request.headers.get("Authorization", "")
        token = auth[7:] if auth.startswith("Bearer ") else ""
        grant = self.sessions.check(token) if token else None
        if grant is None:
            self._refused += 1
            now = self.clock.monotonic()
            if now - self._refused_said >= REFUSALS_SAID_EVERY:
                log.warning(
                    "agent connection(s) refused for want of a valid session: %d since the "
                    "last such line (latest from %s)",
                    self._refused,
                    request.remote,
                )
                self._refused, self._refused_said = 0, now
            return _refuse(401, "no valid session")
        transport = request.transport
        status = self.admit_link(transport.get_extra_info("peername") if transport else None)
        if status:
            log.warning(
                "agent %s from %s refused: no room for another agent link (--p2p-max-conns, "
                "--p2p-max-conns-per-ip)",
                grant.peer_id,
                request.remote,
            )
            return _refuse(status, "too many agent links" + " from this address" * (status == 429))
        try:
            response, ws = await ws_server.accept(
                request, max_size=frames.MAX_FRAME, heartbeat=LINK_HEARTBEAT
            )
        except ws_server.UpgradeRefused as exc:
            log.warning("agent connection from %s refused: %s", request.remote, exc)
            return _refuse(exc.status, str(exc))
        except ConnectionResetError:
            log.info("agent %s left during the WebSocket upgrade", grant.peer_id)
            return web.Response(status=499)
        link = Link(ws, dialer=False, name=f"agent {grant.peer_id}", handlers={})
        binding = Binding(link, grant)
        link.add_handler(ROUTER_PROTOCOL, self._management(binding))
        self.links.add(link)
        try:
            await link.run()
        finally:
            self.links.discard(link)
            record = binding.record
            if record is not None and self.registry.get(record.peer_id) is record:
                log.warning(
                    "agent %s (%s) disconnected: %s",
                    record.peer_id,
                    request.remote,
                    link.close_reason,
                )
                record.disconnected(self.clock.monotonic())
                self.observers.on_agent(AgentEvent("disconnected", record.peer_id, record.model))
                self.registry.announce("disconnected", record)
        return response

    def _management(self, binding: Binding) -> Callable[[Stream], Awaitable[None]]:
        async def handle(stream: Stream) -> None:
            head = stream.request_head
            assert head is not None
            body = await stream.read_all(MAX_CONTROL_BODY)
            status, reply = await self.call(binding, head.path, body)
            await stream.send_head(
                status, [("content-type", "application/json")], orjson.dumps(reply), end=True
            )

        return handle

    async def call(self, binding: Binding, path: str, body: bytes) -> Reply:
        """One management call on a connection: register, renew, heartbeat or routing
        signals. Every call but renewal needs the connection's session to be live."""
        call = self._calls.get(path)
        if call is None:
            return 404, {"error": f"no such call {path}"}
        if path != "/renew" and not self.sessions.live(binding.grant):
            log.warning("agent %s: %s refused, session expired", binding.grant.peer_id, path)
            return 401, {"error": "session expired"}
        try:
            status, reply = call(binding, body)
        except msgspec.ValidationError as exc:
            log.warning("agent %s sent an invalid %s: %s", binding.grant.peer_id, path, exc)
            return 400, {"error": f"invalid {path}: {exc}"}
        except msgspec.DecodeError:
            return 400, {"error": f"malformed {path}"}
        record = binding.record
        if path == "/register" and status == 200 and binding.fresh and record:
            await self.history.restore(record)
        return status, reply

    def _proven(self, signature: str, grant: trust.SessionGrant) -> bool:
        return trust.verify_proof(signature, grant.challenge, grant.peer_id, self.router_peer_id)

    def _register(self, binding: Binding, body: bytes) -> Reply:
        reg = _registration.decode(body)
        grant = binding.grant
        if reg.peer_id != grant.peer_id:
            log.warning(
                "registration refused: session of %s claims peer ID %s", grant.peer_id, reg.peer_id
            )
            return 403, {"error": "peer ID does not match the session"}
        if not self._proven(reg.signature, grant):
            log.warning(
                "registration of %s refused: signature does not match the peer ID", reg.peer_id
            )
            return 403, {"error": "signature does not prove the peer ID"}
        record = AgentRecord(
            reg=reg,
            link=binding.link,
            last_heartbeat=self.clock.monotonic(),
            registered_at=self.clock.wall(),
            backend_healthy=reg.backend_healthy,
            last_seen_wall=self.clock.wall(),
        )
        binding.record = record
        old = self.registry.upsert(record)
        # A reconnect within this process carries its history over in upsert; only an agent
        # this router does not hold is restored from the store (else it would count twice).
        binding.fresh = old is None
        if old is not None and old.link is not None and old.link is not binding.link:
            # Held until done: a task nobody references may be collected before it runs.
            closing = asyncio.get_running_loop().create_task(
                old.link.close("replaced by a new connection")
            )
            self._closing.add(closing)
            closing.add_done_callback(self._closing.discard)
            self._replaced(reg.peer_id)
        log.info(
            "agent %s registered: model %s, %s, engine %s, capacity %d",
            reg.peer_id,
            reg.model,
            reg.capability,
            reg.engine,
            reg.capacity,
        )
        return 200, {"ok": True}

    def _renew(self, binding: Binding, body: bytes) -> Reply:
        renewal = _renewal.decode(body)
        grant = self.sessions.check(renewal.session_token)
        if grant is None:
            log.warning("renewal for %s refused: unknown or expired session", binding.grant.peer_id)
            return 401, {"error": "no valid session"}
        if grant.peer_id != binding.grant.peer_id:
            log.warning(
                "renewal refused: session of %s offered on the connection of %s",
                grant.peer_id,
                binding.grant.peer_id,
            )
            return 403, {"error": "session belongs to another peer"}
        if not self._proven(renewal.signature, grant):
            log.warning("renewal of %s refused: bad signature", grant.peer_id)
            return 403, {"error": "signature does not prove the peer ID"}
        binding.grant = grant
        log.info("agent %s renewed its session", grant.peer_id)
        return 200, {"ok": True}

    def _current(self, binding: Binding) -> AgentRecord | None:
        record = binding.record
        if record is None or self.registry.get(record.peer_id) is not record:
            return None
        return record

    def _heartbeat(self, binding: Binding, body: bytes) -> Reply:
        beat = _heartbeat.decode(body)
        record = self._current(binding)
        if record is None:
            return 409, {"error": "not registered"}
        was_healthy = record.process_healthy and record.backend_healthy
        was_stopping = record.stopping
        if not record.process_healthy:
            log.info("agent %s healthy again", record.peer_id)
        if record.heard(beat, self.clock.monotonic(), self.clock.wall()):
            log.warning("agent %s reports its backend unhealthy", record.peer_id)
            self.observers.on_agent(AgentEvent("backend_down", record.peer_id, record.model))
        if was_healthy != (record.process_healthy and record.backend_healthy):
            self.registry.announce("unhealthy" if was_healthy else "healthy", record)
        if record.stopping and not was_stopping:
            log.info(
                "agent %s is shutting down: no new requests; %d in flight here finish",
                record.peer_id,
                record.active,
            )
            self.registry.announce("stopping", record)
        if record.eligible:
            self.registry.changed(record.model)
        # Discovery: the agent opens a session with every live router of the site.
        return 200, {"ok": True, "routers": self.site_routers()}

    def _signal(self, binding: Binding, body: bytes) -> Reply:
        signal = _signal.decode(body)
        record = self._current(binding)
        if record is None:
            return 409, {"error": "not registered"}
        # Routing signals never count as liveness: only heartbeats do.
        record.sampled(signal.engine, signal.hardware)
        return 200, {"ok": True}

    def _cache_blocks(self, binding: Binding, body: bytes) -> Reply:
        report = _cache_report.decode(body)
        record = self._current(binding)
        if record is None:
            return 409, {"error": "not registered"}
        try:
            self.cache_report(record, report)
        except ValueError as exc:
            log.warning("agent %s sent an invalid cache report: %s", record.peer_id, exc)
            return 400, {"error": f"invalid /cache-blocks: {exc}"}
        return 200, {"ok": True}


def _refuse(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)
