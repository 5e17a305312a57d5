from __future__ import annotations

import base64

import msgspec
import pytest

from hivenet_router.clock import ManualClock
from hivenet_router.domain.agent import (
    EngineSnapshot,
    Heartbeat,
    Registration,
    Renewal,
    RoutingSignal,
)
from hivenet_router.listeners import address_prefix
from hivenet_router.router.agent_auth import FailureLimiter, Sessions
from hivenet_router.router.control import Binding, ControlPlane
from hivenet_router.router.history import HistoryKeeper
from hivenet_router.router.metrics import RouterMetrics
from hivenet_router.router.registry import Registry
from hivenet_router.storage.history import MemoryHistory
from hivenet_router.transport import trust
from hivenet_router.transport.identity import Identity

ROUTER = "router-peer"


class OpenLink:
    closed = False

    async def close(self, reason: str = "") -> None:
        self.closed = True


def plane() -> tuple[ControlPlane, Registry, ManualClock, Sessions]:
    clock = ManualClock()
    metrics = RouterMetrics()
    registry = Registry(metrics)
    sessions = Sessions(clock, 3600)
    control = ControlPlane(
        registry=registry,
        metrics=metrics,
        clock=clock,
        sessions=sessions,
        router_peer_id=ROUTER,
        history=HistoryKeeper(registry, MemoryHistory(), 30.0),
    )
    return control, registry, clock, sessions


def proof(identity: Identity, grant: trust.SessionGrant) -> str:
    message = trust.proof_message(grant.challenge, identity.peer_id, ROUTER)
    return base64.b64encode(identity.sign(message)).decode()


def registration(identity: Identity, grant: trust.SessionGrant, **changes: object) -> bytes:
    fields: dict[str, object] = {
        "peer_id": identity.peer_id,
        "model": "m",
        "capability": "llm",
        "engine": "vllm",
        "capacity": 2,
        "signature": proof(identity, grant),
    }
    fields.update(changes)
    return msgspec.json.encode(Registration(**fields))  # type: ignore[arg-type]


def registered() -> tuple[ControlPlane, Registry, ManualClock, Sessions, Binding, Identity]:
    control, registry, clock, sessions = plane()
    identity = Identity.generate()
    grant = sessions.issue(identity.peer_id)
    binding = Binding(OpenLink(), grant)  # type: ignore[arg-type]
    status, _ = control._register(binding, registration(identity, grant))
    assert status == 200
    return control, registry, clock, sessions, binding, identity


def test_routing_signals_never_refresh_liveness() -> None:
    control, registry, clock, _, binding, identity = registered()
    record = registry.get(identity.peer_id)
    assert record is not None
    seen = record.last_heartbeat
    clock.advance(20)
    signal = RoutingSignal(engine=EngineSnapshot(kv_cache_utilization=0.5))
    assert control._signal(binding, msgspec.json.encode(signal))[0] == 200
    assert record.last_heartbeat == seen
    assert record.engine is not None and record.engine.kv_cache_utilization == 0.5
    beat = Heartbeat(backend_healthy=False)
    assert control._heartbeat(binding, msgspec.json.encode(beat))[0] == 200
    assert record.last_heartbeat == seen + 20
    assert not record.eligible  # the backend is down: out of the pool at once


def test_registration_must_match_the_session_and_prove_the_peer_id() -> None:
    control, registry, _, sessions = plane()
    identity, other = Identity.generate(), Identity.generate()
    grant = sessions.issue(identity.peer_id)
    binding = Binding(OpenLink(), grant)  # type: ignore[arg-type]
    # someone else's peer ID on this session
    body = registration(other, grant)
    assert control._register(binding, body)[0] == 403
    # the right peer ID, signed by the wrong key
    forged = registration(identity, grant, signature=proof(other, grant))
    assert control._register(binding, forged)[0] == 403
    # a signature over another session's challenge
    stale = registration(identity, grant, signature=proof(identity, sessions.issue("x")))
    assert control._register(binding, stale)[0] == 403
    assert control._register(binding, registration(identity, grant, signature=""))[0] == 403
    assert registry.all() == []
    assert control._register(binding, registration(identity, grant))[0] == 200


def test_renewal_rebinds_the_connection() -> None:
    control, registry, _clock, sessions, binding, identity = registered()
    fresh = sessions.issue(identity.peer_id)
    body = msgspec.json.encode(Renewal(session_token=fresh.token, signature=proof(identity, fresh)))
    assert control._renew(binding, body)[0] == 200
    assert binding.grant is fresh
    record = registry.get(identity.peer_id)
    assert record is not None and record.session_digest == fresh.digest
    # a session of another peer cannot be grafted onto this connection
    thief = Identity.generate()
    theirs = sessions.issue(thief.peer_id)
    body = msgspec.json.encode(Renewal(session_token=theirs.token, signature=proof(thief, theirs)))
    assert control._renew(binding, body)[0] == 403
    body = msgspec.json.encode(Renewal(session_token="forged", signature="AAAA"))
    assert control._renew(binding, body)[0] == 401


def test_sessions_expire_and_are_revoked() -> None:
    _, _, clock, sessions = plane()
    grant = sessions.issue("peer-a")
    assert sessions.check(grant.token) is not None
    assert sessions.check("forged") is None
    clock.advance(3601)
    assert sessions.check(grant.token) is None
    again = sessions.issue("peer-a")
    sessions.revoke_peer("peer-a")
    assert sessions.check(again.token) is None
    assert not sessions.live(again)


def test_failed_authentications_are_limited_per_source() -> None:
    clock = ManualClock()
    limiter = FailureLimiter(clock, limit=3)
    for _ in range(3):
        assert not limiter.blocked("10.0.0.1")
        limiter.failed("10.0.0.1")
    assert limiter.blocked("10.0.0.1")
    assert not limiter.blocked("10.0.0.2")
    clock.advance(61)
    assert not limiter.blocked("10.0.0.1")


def test_source_prefixes() -> None:
    assert address_prefix("192.0.2.7") == "192.0.2.7"
    assert address_prefix("2001:db8:1:2:3::1") == address_prefix("2001:db8:1:2:ff::9")
    assert address_prefix("2001:db8:1:200::1") != address_prefix("2001:db8:1:100::1")


def test_oversized_metadata_is_refused() -> None:
    decoder = msgspec.json.Decoder(Registration)
    base = {"peer_id": "p", "model": "m", "capability": "llm", "engine": "vllm", "capacity": 1}
    for bad in (
        {"region": "x" * 300},
        {"capacity": 0},
        {"tags": ["t"] * 100},
        {"llm_info": "i" * 5000},
        {"unexpected": 1},
    ):
        with pytest.raises(msgspec.ValidationError):
            decoder.decode(msgspec.json.encode({**base, **bad}))


async def test_only_a_registration_new_to_the_router_restores_history() -> None:
    control, registry, _, sessions = plane()
    identity = Identity.generate()
    first = sessions.issue(identity.peer_id)
    binding = Binding(OpenLink(), first)  # type: ignore[arg-type]
    assert control._register(binding, registration(identity, first))[0] == 200
    assert binding.fresh
    record = registry.get(identity.peer_id)
    assert record is not None
    record.successes = 5
    # The same agent on a new connection: its history rides over in the registry.
    again = sessions.issue(identity.peer_id)
    second = Binding(OpenLink(), again)  # type: ignore[arg-type]
    assert control._register(second, registration(identity, again))[0] == 200
    assert not second.fresh
    current = registry.get(identity.peer_id)
    assert current is not None and current.successes == 5
