"""How an agent gets a session from its router, and proves its peer ID with it.

`RouterAuth` is the small interface the agent's lifecycle depends on; `HttpsRouterAuth`
speaks the authentication endpoint over TLS 1.3 pinned to the key derived from the shared
secret.
"""

from __future__ import annotations

import base64
import time
from dataclasses import dataclass
from typing import Protocol

import aiohttp

from hivenet_router.config.values import ListenAddress, split_multiaddr
from hivenet_router.transport import trust
from hivenet_router.transport.identity import Identity
from hivenet_router.transport.tls import RouterTlsIdentity

AUTH_PATH = "/hivenet.auth.v1/authenticate"
LINK_PATH = "/hivenet/link"
CALL_TIMEOUT = 10.0


class RouterRejected(Exception):
    """The router refused this agent; the message says why."""


@dataclass(frozen=True, slots=True)
class Session:
    token: str
    challenge: bytes
    router_peer_id: str
    link_url: str
    heartbeat_interval: float
    renew_at: float  # monotonic time at which to renew
    expires_at: float  # monotonic time after which the router refuses it

    def proof(self, identity: Identity) -> str:
        """The signature that proves this agent owns its peer ID, for this session."""
        message = trust.proof_message(self.challenge, identity.peer_id, self.router_peer_id)
        return base64.b64encode(identity.sign(message)).decode()


class RouterAuth(Protocol):
    async def authenticate(self) -> Session: ...


class HttpsRouterAuth:
    def __init__(
        self,
        http: aiohttp.ClientSession,
        router: ListenAddress,
        secret: bytes,
        identity: Identity,
        capacity: int,
    ) -> None:
        self._http = http
        self._router = router
        self._secret = secret
        self._identity = identity
        self._capacity = capacity
        self._tls = RouterTlsIdentity.from_secret(secret).client_context()

    async def authenticate(self) -> Session:
        token = trust.agent_token(self._secret, self._identity.peer_id)
        started = time.monotonic()
        async with self._http.post(
            f"https://{self._router}{AUTH_PATH}",
            json={"token": token, "capacity": self._capacity},
            ssl=self._tls,
            timeout=aiohttp.ClientTimeout(total=CALL_TIMEOUT),
        ) as resp:
            body = await resp.json(content_type=None)
            if resp.status != 200:
                reason = body.get("error") if isinstance(body, dict) else None
                raise RouterRejected(str(reason or f"HTTP {resp.status}"))
        try:
            addrs = body.get("addrs") or []
            host, port = split_multiaddr(str(addrs[0]))
            ttl = float(body["session_ttl_s"])
            margin = float(body["renew_margin_s"])
            challenge = base64.b64decode(body["challenge"])
        except (IndexError, KeyError, TypeError, ValueError) as exc:
            raise RouterRejected(f"unusable authentication answer: {exc}") from None
        if host in {"0.0.0.0", "::"}:
            host = self._router.host
        host_part = f"[{host}]" if ":" in host else host
        return Session(
            token=str(body["session_token"]),
            challenge=challenge,
            router_peer_id=str(body.get("router_peer_id", "")),
            link_url=f"wss://{host_part}:{port}{LINK_PATH}",
            heartbeat_interval=float(body.get("heartbeat_interval_ms", 5000)) / 1000,
            renew_at=started + max(ttl - margin, 0.0),
            expires_at=started + ttl,
        )
