"""The agent control plane: authentication, the agent connection, and management calls.

Authentication (on --grpc-port, TLS 1.3 with the pinned derived key): the agent sends its
JWT; the router answers with a session token, its peer ID and the address to dial. The data
connection (on --p2p-port, same TLS identity) is a WebSocket upgrade that must carry a live
session token. Registration, heartbeats and routing signals then travel as calls on the
router protocol of that connection; none of them exists on the public HTTP port.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections import Counter
from collections.abc import Awaitable, Callable

import msgspec
import orjson
from aiohttp import web

from hivenet_router.clock import Clock
from hivenet_router.domain.agent import (
    EngineSnapshot,
    HardwareSnapshot,
    Heartbeat,
    Registration,
    RoutingSignal,
)
from hivenet_router.router.metrics import RouterMetrics
from hivenet_router.router.registry import AgentRecord, Registry
from hivenet_router.transport import frames, trust
from hivenet_router.transport.link import ROUTER_PROTOCOL, Link, Stream

log = logging.getLogger("hivenet.auth")

AUTH_PATH = "/hivenet.auth.v1/authenticate"
LINK_PATH = "/hivenet/link"
MAX_CONTROL_BODY = 64 * 1024

_registration = msgspec.json.Decoder(Registration)
_heartbeat = msgspec.json.Decoder(Heartbeat)
_signal = msgspec.json.Decoder(RoutingSignal)


def _source_prefix(peer: str) -> str:
    """IPv4 addresses count alone, IPv6 addresses by their /56."""
    try:
        address = ipaddress.ip_address(peer)
    except ValueError:
        return peer
    if address.version == 6:
        return str(ipaddress.ip_network(f"{address}/56", strict=False))
    return str(address)


class Sessions:
    """Session tokens, stored by digest, bound to a peer ID, with an expiry."""

    def __init__(self, clock: Clock, ttl: float) -> None:
        self._clock = clock
        self._ttl = ttl
        self._by_digest: dict[bytes, trust.SessionGrant] = {}

    def issue(self, peer_id: str) -> trust.SessionGrant:
        now = self._clock.wall()
        self._by_digest = {d: g for d, g in self._by_digest.items() if g.expires_at > now}
        grant = trust.new_session(peer_id, self._ttl, now)
        self._by_digest[grant.digest] = grant
        return grant

    def check(self, token: str) -> trust.SessionGrant | None:
        grant = self._by_digest.get(trust.token_digest(token))
        if grant is None or grant.expires_at <= self._clock.wall():
            return None
        return grant

    def revoke_peer(self, peer_id: str) -> None:
        self._by_digest = {d: g for d, g in self._by_digest.items() if g.peer_id != peer_id}


class ControlPlane:
    def __init__(
        self,
        *,
        registry: Registry,
        metrics: RouterMetrics,
        clock: Clock,
        secret: bytes,
        sessions: Sessions,
        router_peer_id: str,
        announce: str,
        heartbeat_interval: float,
        max_conns_per_ip: int,
    ) -> None:
        self.registry = registry
        self.metrics = metrics
        self.clock = clock
        self.secret = secret
        self.sessions = sessions
        self.router_peer_id = router_peer_id
        self.announce = announce
        self.heartbeat_interval = heartbeat_interval
        self.max_conns_per_ip = max_conns_per_ip
        self._conns: Counter[str] = Counter()
        self.links: set[Link] = set()

    # -- authentication -------------------------------------------------------------------------

    def auth_app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_CONTROL_BODY)
        app.router.add_post(AUTH_PATH, self.authenticate)
        return app

    async def authenticate(self, request: web.Request) -> web.Response:
        try:
            body = orjson.loads(await request.read())
            token = body["token"]
            capacity = body.get("capacity", 1)
            if not isinstance(token, str) or not isinstance(capacity, int):
                raise TypeError
        except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
            log.warning("authentication from %s refused: malformed request", request.remote)
            return _refuse(400, "malformed authentication request")
        try:
            peer_id = trust.verify_agent_token(self.secret, token, self.clock.wall())
        except trust.TrustError as exc:
            log.warning("authentication from %s refused: %s", request.remote, exc)
            return _refuse(401, "authentication failed")
        if capacity <= 0:
            log.warning("authentication of %s refused: capacity %d", peer_id, capacity)
            return _refuse(400, "capacity must be positive")
        grant = self.sessions.issue(peer_id)
        log.info("agent %s authenticated from %s", peer_id, request.remote)
        return web.json_response(
            {
                "session_token": grant.token,
                "router_peer_id": self.router_peer_id,
                "addrs": [self.announce],
                "heartbeat_interval_ms": int(self.heartbeat_interval * 1000),
                "session_expires_at": grant.expires_at,
            }
        )

    # -- the agent connection -------------------------------------------------------------------

    def link_app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_CONTROL_BODY)
        app.router.add_get(LINK_PATH, self.accept_link)
        return app

    async def accept_link(self, request: web.Request) -> web.StreamResponse:
        auth = request.headers.get("Authorization", "")
        token = auth[7:] if auth.startswith("Bearer ") else ""
        grant = self.sessions.check(token) if token else None
        if grant is None:
            log.warning("agent connection from %s refused: no valid session", request.remote)
            return _refuse(401, "no valid session")
        source = _source_prefix(request.remote or "")
        if self._conns[source] >= self.max_conns_per_ip:
            log.warning(
                "agent connection from %s refused: %d connections from %s already",
                request.remote,
                self._conns[source],
                source,
            )
            return _refuse(429, "too many connections from this address")
        ws = web.WebSocketResponse(
            heartbeat=5.0, max_msg_size=frames.WS_MAX_MSG_SIZE, autoping=True
        )
        await ws.prepare(request)
        self._conns[source] += 1
        holder: list[AgentRecord] = []
        link = Link(
            ws,
            dialer=False,
            name=f"agent {grant.peer_id}",
            handlers={ROUTER_PROTOCOL: self._management(grant, holder)},
        )
        self.links.add(link)
        try:
            await link.run()
        finally:
            self.links.discard(link)
            self._conns[source] -= 1
            if self._conns[source] <= 0:
                del self._conns[source]
            record = holder[0] if holder else None
            if record is not None and self.registry.get(record.peer_id) is record:
                log.warning("agent %s disconnected: %s", record.peer_id, link.close_reason)
                record.disconnected_at = self.clock.monotonic()
                self.metrics.disconnections.labels(record.peer_id).inc()
        return ws

    def _management(
        self, grant: trust.SessionGrant, holder: list[AgentRecord]
    ) -> Callable[[Stream], Awaitable[None]]:
        async def handle(stream: Stream) -> None:
            head = stream.request_head
            assert head is not None
            body = await stream.read_all(MAX_CONTROL_BODY)
            try:
                if head.path == "/register":
                    status, reply = self._register(stream.link, grant, body, holder)
                elif head.path == "/heartbeat":
                    status, reply = self._heartbeat(holder, body)
                elif head.path == "/routing-signals":
                    status, reply = self._signal(holder, body)
                else:
                    status, reply = 404, {"error": f"no such call {head.path}"}
            except msgspec.ValidationError as exc:
                log.warning("agent %s sent an invalid %s: %s", grant.peer_id, head.path, exc)
                status, reply = 400, {"error": f"invalid {head.path}: {exc}"}
            except msgspec.DecodeError:
                status, reply = 400, {"error": f"malformed {head.path}"}
            await _answer(stream, status, reply)

        return handle

    def _register(
        self, link: Link, grant: trust.SessionGrant, body: bytes, holder: list[AgentRecord]
    ) -> tuple[int, dict[str, object]]:
        reg = _registration.decode(body)
        if reg.peer_id != grant.peer_id:
            log.warning(
                "registration refused: session of %s claims peer ID %s", grant.peer_id, reg.peer_id
            )
            return 403, {"error": "peer ID does not match the session"}
        now = self.clock.monotonic()
        record = AgentRecord(
            reg=reg,
            link=link,
            session_digest=grant.digest,
            last_heartbeat=now,
            registered_at=self.clock.wall(),
            backend_healthy=reg.backend_healthy,
            meters=self.metrics.agent_meters(reg.peer_id, reg.model),
        )
        holder[:] = [record]
        old = self.registry.upsert(record)
        if old is not None and old.link is not None and old.link is not link:
            asyncio.get_running_loop().create_task(old.link.close("replaced by a new connection"))
        log.info(
            "agent %s registered: model %s, %s, engine %s, capacity %d",
            reg.peer_id,
            reg.model,
            reg.capability,
            reg.engine,
            reg.capacity,
        )
        return 200, {"ok": True}

    def _current(self, holder: list[AgentRecord]) -> AgentRecord | None:
        record = holder[0] if holder else None
        if record is None or self.registry.get(record.peer_id) is not record:
            return None
        return record

    def _heartbeat(self, holder: list[AgentRecord], body: bytes) -> tuple[int, dict[str, object]]:
        beat = _heartbeat.decode(body)
        record = self._current(holder)
        if record is None:
            return 409, {"error": "not registered"}
        record.last_heartbeat = self.clock.monotonic()
        if not record.process_healthy:
            log.info("agent %s healthy again", record.peer_id)
        record.process_healthy = True
        if record.backend_healthy and not beat.backend_healthy:
            log.warning("agent %s reports its backend unhealthy", record.peer_id)
            self.metrics.backend_failure.labels(record.model).inc()
        record.backend_healthy = beat.backend_healthy
        self._snapshots(record, beat.engine, beat.hardware)
        self.metrics.agent_healthy.labels(record.peer_id, record.model).set(
            1 if record.eligible else 0
        )
        self.metrics.agent_last_seen.labels(record.peer_id).set(self.clock.wall())
        if record.eligible:
            self.registry.on_join(record.model)
        return 200, {"ok": True}

    def _signal(self, holder: list[AgentRecord], body: bytes) -> tuple[int, dict[str, object]]:
        signal = _signal.decode(body)
        record = self._current(holder)
        if record is None:
            return 409, {"error": "not registered"}
        # Routing signals never count as liveness: only heartbeats do.
        self._snapshots(record, signal.engine, signal.hardware)
        return 200, {"ok": True}

    def _snapshots(
        self,
        record: AgentRecord,
        engine: EngineSnapshot | None,
        hardware: HardwareSnapshot | None,
    ) -> None:
        if engine is not None:
            record.engine = engine
            for name, gauge in self.metrics.engine.items():
                value = getattr(engine, name)
                if value is not None:
                    gauge.labels(record.peer_id, record.model).set(value)
        if hardware is not None:
            record.hardware = hardware


async def _answer(stream: Stream, status: int, reply: dict[str, object]) -> None:
    await stream.send_head(
        status, [("content-type", "application/json")], orjson.dumps(reply), end=True
    )


def _refuse(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)
