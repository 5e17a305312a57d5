"""Agent trust, attacked: forged tokens, stolen sessions, false signatures, wrong keys,
floods. Nobody may register, the router keeps serving, and each refusal is logged."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx2 as httpx
import jwt
import orjson
import pytest

from hivenet_router.agent.session import RouterRejected, call_authenticate
from hivenet_router.config.values import ListenAddress
from hivenet_router.transport import trust, websocket
from hivenet_router.transport.identity import Identity
from hivenet_router.transport.link import ROUTER_PROTOCOL, Link
from hivenet_router.transport.tls import GRPC_ALPN, RouterTlsIdentity
from tests.linkpair import dialled
from tests.procs import Cluster, Router, wait_registered, wait_until

MODEL = "m"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def secret_of(cluster: Cluster) -> bytes:
    return cluster.secret_file.read_bytes().strip()


async def authenticate(
    router: Router, secret: bytes, body: dict[str, object], alpn: tuple[str, ...] = ()
) -> dict[str, object]:
    tls = RouterTlsIdentity.from_secret(secret).client_context(alpn)
    answer = await call_authenticate(
        ListenAddress("127.0.0.1", router.grpc), tls, orjson.dumps(body)
    )
    result = orjson.loads(answer)
    assert isinstance(result, dict)
    return result


@dataclass
class FakeAgent:
    link: Link
    session: dict[str, object]
    reader: asyncio.Task[None]

    async def register(self, identity: Identity, **changes: object) -> int:
        challenge = base64.b64decode(str(self.session["challenge"]))
        message = trust.proof_message(
            challenge, identity.peer_id, str(self.session["router_peer_id"])
        )
        fields: dict[str, object] = {
            "peer_id": identity.peer_id,
            "model": MODEL,
            "capability": "llm",
            "engine": "vllm",
            "capacity": 1,
            "signature": base64.b64encode(identity.sign(message)).decode(),
        }
        fields.update(changes)
        status, _ = await self.link.call(ROUTER_PROTOCOL, "/register", orjson.dumps(fields), 10)
        return status


@contextlib.asynccontextmanager
async def connect(
    router: Router, secret: bytes, token: str, session: dict[str, object]
) -> AsyncIterator[FakeAgent]:
    """A link opened the way an agent opens it (the agent's own WebSocket client)."""
    tls = RouterTlsIdentity.from_secret(secret).client_context()
    url = f"wss://127.0.0.1:{router.p2p}/hivenet/link"
    async with dialled(url, tls, {"Authorization": f"Bearer {token}"}, "fake") as (link, _, reader):
        yield FakeAgent(link, session, reader)


async def session_for(router: Router, secret: bytes, identity: Identity) -> dict[str, object]:
    return await authenticate(
        router, secret, {"token": trust.agent_token(secret, identity.peer_id), "capacity": 1}
    )


async def test_forged_tokens_are_refused_and_logged_without_secrets(
    make_cluster: Cluster,
) -> None:
    router = make_cluster.router("--auth-failure-limit", "50")
    secret = secret_of(make_cluster)
    peer = Identity.generate().peer_id
    now = int(time.time())
    claims = {"sub": peer, "iss": trust.ISSUER, "aud": trust.AUDIENCE}
    good = trust.agent_token(secret, peer)
    header, _payload, signature = good.split(".")
    tampered_payload = (
        base64.urlsafe_b64encode(
            orjson.dumps({**claims, "sub": "12D3KooWsomeoneelse", "iat": now, "exp": now + 3600})
        )
        .rstrip(b"=")
        .decode()
    )
    forged = {
        "wrong secret": trust.agent_token(b"w" * 32, peer),
        "expired": jwt.encode(
            {**claims, "iat": now - 7200, "exp": now - 3600}, secret, algorithm="HS256"
        ),
        "future-dated": jwt.encode(
            {**claims, "iat": now + 3600, "exp": now + 7200}, secret, algorithm="HS256"
        ),
        "unsigned": jwt.encode({**claims, "iat": now, "exp": now + 3600}, None, algorithm="none"),
        "tampered": f"{header}.{tampered_payload}.{signature}",
        "too long-lived": jwt.encode(
            {**claims, "iat": now, "exp": now + 86400}, secret, algorithm="HS256"
        ),
        "no subject": jwt.encode(
            {"iss": trust.ISSUER, "aud": trust.AUDIENCE, "iat": now, "exp": now + 60},
            secret,
            algorithm="HS256",
        ),
    }
    for name, token in forged.items():
        with pytest.raises(RouterRejected, match="UNAUTHENTICATED"):
            await authenticate(router, secret, {"token": token, "capacity": 1})
        assert token not in router.proc.log(), name
    with pytest.raises(RouterRejected, match="INVALID_ARGUMENT"):
        await authenticate(router, secret, {"token": good, "capacity": 0})
    with pytest.raises(RouterRejected, match="INVALID_ARGUMENT"):
        await authenticate(router, secret, {"nothing": True})
    log = router.proc.log()
    assert log.count("agent authentication from 127.0.0.1 refused") >= len(forged)
    assert secret.decode() not in log
    assert await authenticate(router, secret, {"token": good, "capacity": 1})


async def test_failed_attempts_are_rate_limited(make_cluster: Cluster) -> None:
    router = make_cluster.router("--auth-failure-limit", "3")
    secret = secret_of(make_cluster)
    bad = trust.agent_token(b"x" * 32, "peer")
    for _ in range(3):
        with pytest.raises(RouterRejected, match="UNAUTHENTICATED"):
            await authenticate(router, secret, {"token": bad})
    for _ in range(2):
        with pytest.raises(RouterRejected, match="RESOURCE_EXHAUSTED"):
            await authenticate(router, secret, {"token": bad})
    assert router.proc.log().count("refused for up to 60s") == 1
    # A real agent on the same address still gets in: only failures are throttled.
    good = trust.agent_token(secret, Identity.generate().peer_id)
    assert await authenticate(router, secret, {"token": good, "capacity": 1})


async def test_the_grpc_port_selects_h2_for_clients_that_offer_it(make_cluster: Cluster) -> None:
    """gRPC clients built on grpc-go refuse a server that selects no protocol in ALPN; the
    router selects h2 when it is offered and serves clients that offer nothing as well."""
    router = make_cluster.router()
    secret = secret_of(make_cluster)
    for offered, selected in ((GRPC_ALPN, "h2"), ((), None)):
        tls = RouterTlsIdentity.from_secret(secret).client_context(offered)
        _, writer = await asyncio.open_connection(
            "127.0.0.1", router.grpc, ssl=tls, server_hostname="hivenet-router"
        )
        assert writer.get_extra_info("ssl_object").selected_alpn_protocol() == selected
        writer.transport.abort()  # the server's HTTP/2 greeting may cross a TLS goodbye
        token = trust.agent_token(secret, Identity.generate().peer_id)
        session = await authenticate(router, secret, {"token": token, "capacity": 1}, offered)
        assert session["session_token"]


async def test_agent_with_the_wrong_secret_refuses_the_router(make_cluster: Cluster) -> None:
    # From the agent's side, a router with another key is a man in the middle.
    router = make_cluster.router()
    sim = make_cluster.sim(MODEL, "--zero-latency")
    intruder_secret = make_cluster.tmp / "other.secret"
    trust.write_secret(intruder_secret)
    make_cluster.secret_file, real = intruder_secret, make_cluster.secret_file
    agent = make_cluster.agent(router, sim, name="intruder")
    make_cluster.secret_file = real
    wait_until(lambda: "does not match the shared secret" in agent.log(), timeout=15)
    assert router.models() == []
    # The router keeps serving real agents meanwhile.
    make_cluster.agent(router, sim, name="agent")
    wait_registered(router, MODEL)
    assert httpx.post(router.url + "/v1/chat/completions", json=CHAT, timeout=10).status_code == 200


async def test_stolen_and_forged_registrations(make_cluster: Cluster) -> None:
    router = make_cluster.router()
    secret = secret_of(make_cluster)
    victim, thief = Identity.generate(), Identity.generate()
    session = await session_for(router, secret, victim)
    async with connect(router, secret, str(session["session_token"]), session) as fake:
        # The victim's session, used by another peer ID, signed by that peer.
        assert await fake.register(thief) == 403
        # The victim's peer ID, but a signature the victim did not make.
        forged = base64.b64encode(thief.sign(b"anything")).decode()
        assert await fake.register(victim, signature=forged) == 403
        # Oversized metadata.
        assert await fake.register(victim, region="r" * 5000) == 400
        assert router.models() == []
        assert await fake.register(victim) == 200
    log = router.proc.log()
    assert "claims peer ID" in log
    assert "signature does not match the peer ID" in log
    assert "sent an invalid /register" in log


async def test_no_session_no_connection(make_cluster: Cluster) -> None:
    router = make_cluster.router()
    secret = secret_of(make_cluster)
    with pytest.raises(websocket.HandshakeError) as info:
        async with connect(router, secret, "made-up-token", {}):
            pass
    assert info.value.status == 401


async def test_session_replayed_after_removal_is_refused(make_cluster: Cluster) -> None:
    router = make_cluster.router()
    secret = secret_of(make_cluster)
    identity = Identity.generate()
    session = await session_for(router, secret, identity)
    token = str(session["session_token"])
    async with connect(router, secret, token, session) as fake:
        assert await fake.register(identity) == 200
        # No heartbeats: removed after --remove-after (5s); removal revokes the session.
        wait_until(lambda: MODEL not in router.models(), timeout=10)
    with pytest.raises(websocket.HandshakeError) as info:
        async with connect(router, secret, token, session):
            pass
    assert info.value.status == 401


async def test_connection_flood_from_one_address(make_cluster: Cluster) -> None:
    router = make_cluster.router("--p2p-max-conns-per-ip", "2")
    secret = secret_of(make_cluster)
    identity = Identity.generate()
    session = await session_for(router, secret, identity)
    token = str(session["session_token"])
    async with connect(router, secret, token, session), connect(router, secret, token, session):
        with pytest.raises(websocket.HandshakeError) as info:
            async with connect(router, secret, token, session):
                pass
        assert info.value.status == 429
    assert "agent links: refused 1 connection(s) over the limits" in router.proc.log()


def test_renewal_keeps_streams_alive(make_cluster: Cluster) -> None:
    router = make_cluster.router("--session-ttl", "3s", "--session-renew-margin", "2s")
    sim = make_cluster.sim(MODEL, "--itl", "100ms", "--ttft-base", "0")
    make_cluster.agent(router, sim, "--session-retry-interval", "500ms")
    wait_registered(router, MODEL)
    body = {**CHAT, "max_tokens": 50, "stream": True}  # about 5 s, beyond the 3 s session
    with httpx.stream("POST", router.url + "/v1/chat/completions", json=body, timeout=20) as reply:
        text = reply.read().decode()
    assert text.rstrip().endswith("data: [DONE]")
    assert router.proc.log().count("renewed its session") >= 2
    assert router.healthy_replicas(MODEL) == 1
    assert httpx.post(router.url + "/v1/chat/completions", json=CHAT, timeout=10).status_code == 200


def test_identity_file_is_private_and_stable(make_cluster: Cluster) -> None:
    router = make_cluster.router()
    sim = make_cluster.sim(MODEL, "--zero-latency")
    agent = make_cluster.agent(router, sim)
    wait_registered(router, MODEL)
    key = make_cluster.tmp / "agent.key"
    assert key.stat().st_mode & 0o777 == 0o600
    first = Identity.decode(key.read_bytes()).peer_id
    assert first in agent.log()
    agent.stop()
    again = make_cluster.agent(router, sim, name="agent")
    wait_until(lambda: "registered with router" in again.log(), timeout=15)
    assert Identity.decode(key.read_bytes()).peer_id == first
    assert again.log().count(first) >= 2
