"""How an agent gets a session from its router, and proves its peer ID with it.

`RouterAuth` is the small interface the agent's lifecycle depends on; `GrpcRouterAuth`
calls the router's authentication RPC (gRPC) through TLS 1.3 pinned to the key derived
from the shared secret.
"""

from __future__ import annotations

import asyncio
import base64
import ssl
import time
from dataclasses import dataclass
from typing import Protocol

import orjson

from hivenet_router.agent.discovery import Listed, parse_routers
from hivenet_router.config.values import ListenAddress, split_multiaddr
from hivenet_router.transport import trust
from hivenet_router.transport.grpc_unary import CallFailed, unary_call
from hivenet_router.transport.identity import Identity
from hivenet_router.transport.tls import GRPC_ALPN, RouterTlsIdentity

SERVICE = "hivenet.auth.v1.AgentAuth"
METHOD = "Authenticate"
LINK_PATH = "/hivenet/link"
CALL_TIMEOUT = 10.0
TLS_NAME = "hivenet-router"  # the name in the router's derived certificate


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
    # Which router of the site answered ("" from a router too old to say), and the site's
    # live routers it knows of (discovery).
    router_id: str = ""
    routers: tuple[Listed, ...] = ()

    def proof(self, identity: Identity) -> str:
        """The signature that proves this agent owns its peer ID, for this session."""
        message = trust.proof_message(self.challenge, identity.peer_id, self.router_peer_id)
        return base64.b64encode(identity.sign(message)).decode()


class RouterAuth(Protocol):
    async def authenticate(self) -> Session: ...


async def call_authenticate(router: ListenAddress, tls: ssl.SSLContext, request: bytes) -> bytes:
    """One Authenticate call through a fresh pinned TLS connection; the raw JSON answer.

    Raises RouterRejected when the router refuses (or its key is not the expected one) and
    ConnectionError when it cannot be reached.
    """
    try:
        async with asyncio.timeout(CALL_TIMEOUT):
            reader, writer = await asyncio.open_connection(
                router.host, router.port, ssl=tls, server_hostname=TLS_NAME
            )
    except ssl.SSLCertVerificationError:
        raise RouterRejected(
            "the router's TLS key does not match the shared secret "
            "(wrong secret, or a man in the middle)"
        ) from None
    except TimeoutError:
        message = f"router unreachable: no TLS session within {CALL_TIMEOUT:g} s"
        raise ConnectionError(message) from None
    except OSError as exc:
        raise ConnectionError(f"router unreachable: {exc}") from None
    try:
        return await unary_call(
            reader,
            writer,
            authority=TLS_NAME,
            path=f"/{SERVICE}/{METHOD}",
            request=request,
            timeout=CALL_TIMEOUT,
        )
    except CallFailed as exc:
        if exc.code in ("UNAVAILABLE", "DEADLINE_EXCEEDED"):
            raise ConnectionError(f"router unreachable: {exc.details}") from None
        raise RouterRejected(str(exc)) from None


class GrpcRouterAuth:
    """One authentication = one gRPC call through a fresh TLS 1.3 connection that accepts
    exactly the router's derived certificate (transport/grpc_unary.py speaks the call)."""

    def __init__(
        self,
        router: ListenAddress,
        secret: bytes,
        identity: Identity,
        capacity: int,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self._router = router
        self._secret = secret
        self._identity = identity
        self._capacity = capacity
        # Every router of a site has the same key: one context serves them all. It offers
        # HTTP/2 in ALPN, as every gRPC client does.
        self._tls = tls or RouterTlsIdentity.from_secret(secret).client_context(GRPC_ALPN)

    async def authenticate(self) -> Session:
        token = trust.agent_token(self._secret, self._identity.peer_id)
        started = time.monotonic()
        request = orjson.dumps({"token": token, "capacity": self._capacity})
        answer = await call_authenticate(self._router, self._tls, request)
        return self._session(orjson.loads(answer), started)

    def _session(self, body: object, started: float) -> Session:
        try:
            assert isinstance(body, dict)
            host, port = split_multiaddr(str(body["addrs"][0]))
            ttl = float(body["session_ttl_s"])
            margin = float(body["renew_margin_s"])
            challenge = base64.b64decode(body["challenge"])
            token = str(body["session_token"])
        except (AssertionError, IndexError, KeyError, TypeError, ValueError) as exc:
            raise RouterRejected(f"unusable authentication answer: {exc!r}") from None
        if host in {"0.0.0.0", "::"}:
            host = self._router.host
        host_part = f"[{host}]" if ":" in host else host
        return Session(
            token=token,
            challenge=challenge,
            router_peer_id=str(body.get("router_peer_id", "")),
            link_url=f"wss://{host_part}:{port}{LINK_PATH}",
            heartbeat_interval=float(body.get("heartbeat_interval_ms", 5000)) / 1000,
            renew_at=started + max(ttl - margin, 0.0),
            expires_at=started + ttl,
            router_id=str(body.get("router_id") or ""),
            routers=tuple(parse_routers(body.get("routers"))),
        )
