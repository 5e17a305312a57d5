"""Agent authentication: the endpoint agents call first, and the sessions it hands out.

An agent proves it knows the shared secret with a JWT and receives a session: a random
token (stored here only as a digest), bound to the peer ID the JWT names, with a random
challenge the agent must sign with its identity key when it registers or renews, and an
expiry. Failed attempts are limited per source address.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Callable
from dataclasses import dataclass

import orjson

from hivenet_router.clock import Clock
from hivenet_router.transport import trust

log = logging.getLogger("hivenet.auth")

MAX_AUTH_BODY = 16 * 1024
FAILURE_WINDOW = 60.0


class Sessions:
    """Session tokens, stored by digest, bound to a peer ID, with an expiry."""

    def __init__(self, clock: Clock, ttl: float) -> None:
        self._clock = clock
        self.ttl = ttl
        self._by_digest: dict[bytes, trust.SessionGrant] = {}

    def issue(self, peer_id: str) -> trust.SessionGrant:
        now = self._clock.wall()
        self._by_digest = {d: g for d, g in self._by_digest.items() if g.expires_at > now}
        grant = trust.new_session(peer_id, self.ttl, now)
        self._by_digest[grant.digest] = grant
        return grant

    def check(self, token: str) -> trust.SessionGrant | None:
        grant = self._by_digest.get(trust.token_digest(token))
        if grant is None or not self.live(grant):
            return None
        return grant

    def live(self, grant: trust.SessionGrant) -> bool:
        return grant.expires_at > self._clock.wall() and grant.digest in self._by_digest

    def revoke_peer(self, peer_id: str) -> None:
        self._by_digest = {d: g for d, g in self._by_digest.items() if g.peer_id != peer_id}


@dataclass
class _Window:
    started: float
    failures: int
    announced: bool = False


class FailureLimiter:
    """At most `limit` failed authentications per source and minute are answered (and
    logged) one by one; past that, failures get 429 and one log line per window."""

    def __init__(self, clock: Clock, limit: int) -> None:
        self._clock = clock
        self._limit = limit
        self._windows: dict[str, _Window] = {}

    def blocked(self, source: str) -> bool:
        window = self._windows.get(source)
        if window is None:
            return False
        if self._clock.monotonic() - window.started >= FAILURE_WINDOW:
            del self._windows[source]
            return False
        if window.failures < self._limit:
            return False
        if not window.announced:
            window.announced = True
            log.warning(
                "agent authentication from %s refused for up to %.0fs: %d failures",
                source,
                FAILURE_WINDOW,
                window.failures,
            )
        return True

    def failed(self, source: str) -> None:
        now = self._clock.monotonic()
        if len(self._windows) > 10_000:  # bound the table under a wide flood
            self._windows = {
                s: w for s, w in self._windows.items() if now - w.started < FAILURE_WINDOW
            }
        window = self._windows.get(source)
        if window is None or now - window.started >= FAILURE_WINDOW:
            self._windows[source] = _Window(now, 1)
        else:
            window.failures += 1


class AgentAuthenticator:
    def __init__(
        self,
        *,
        secret: bytes,
        sessions: Sessions,
        clock: Clock,
        router_peer_id: str,
        announce: str,
        heartbeat_interval: float,
        renew_margin: float,
        failure_limit: int,
        router_id: str = "",
        site_routers: Callable[[], list[dict[str, str]]] = list,
    ) -> None:
        self.router_id = router_id
        # Discovery: the live routers of the site, handed to agents (see domain/site.py).
        self.site_routers = site_routers
        self.secret = secret
        self.sessions = sessions
        self.clock = clock
        self.router_peer_id = router_peer_id
        self.announce = announce
        self.heartbeat_interval = heartbeat_interval
        self.renew_margin = renew_margin
        self.failures = FailureLimiter(clock, failure_limit)

    def answer(self, body: bytes, source: str) -> tuple[int, dict[str, object]]:
        """Check one authentication request from `source`; (status, answer) as HTTP would
        say it. The transport that carried it maps the status to its own codes.

        A valid credential is always accepted: the failure limit only throttles the
        failures, so a flood of bad attempts from one address cannot lock out a real agent
        that shares it (checking an HMAC costs microseconds)."""
        try:
            request = orjson.loads(body)
            token = request["token"]
            capacity = request.get("capacity", 1)
            if not isinstance(token, str) or not isinstance(capacity, int):
                raise TypeError
        except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
            return self._failed(source, "malformed authentication request", 400)
        try:
            peer_id = trust.verify_agent_token(self.secret, token, self.clock.wall())
        except trust.TrustError as exc:
            return self._failed(source, str(exc), 401)
        if capacity <= 0:
            log.warning("authentication of %s refused: capacity %d", peer_id, capacity)
            return 400, {"error": "capacity must be positive"}
        grant = self.sessions.issue(peer_id)
        log.info("agent %s authenticated from %s", peer_id, source)
        return 200, {
            "session_token": grant.token,
            "challenge": base64.b64encode(grant.challenge).decode(),
            "router_peer_id": self.router_peer_id,
            "addrs": [self.announce],
            "heartbeat_interval_ms": int(self.heartbeat_interval * 1000),
            "session_ttl_s": self.sessions.ttl,
            "renew_margin_s": self.renew_margin,
            # Every router of a site derives the same key, so the same peer ID: the agent
            # tells routers apart by router_id, and dials the others from `routers`.
            "router_id": self.router_id,
            "routers": self.site_routers(),
        }

    def _failed(self, source: str, reason: str, status: int) -> tuple[int, dict[str, object]]:
        if self.failures.blocked(source):
            return 429, {"error": "too many failed attempts; retry later"}
        # The reason names what failed, never the token or the secret.
        log.warning("agent authentication from %s refused: %s", source, reason)
        self.failures.failed(source)
        return status, {"error": "authentication failed" if status == 401 else reason}
