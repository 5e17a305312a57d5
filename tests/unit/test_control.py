from __future__ import annotations

import msgspec

from hivenet_router.clock import ManualClock
from hivenet_router.domain.agent import EngineSnapshot, Heartbeat, Registration, RoutingSignal
from hivenet_router.router.control import ControlPlane, Sessions
from hivenet_router.router.metrics import RouterMetrics
from hivenet_router.router.registry import Registry


class OpenLink:
    closed = False


def plane() -> tuple[ControlPlane, Registry, ManualClock, Sessions]:
    clock = ManualClock()
    metrics = RouterMetrics()
    registry = Registry(metrics)
    sessions = Sessions(clock, 3600)
    control = ControlPlane(
        registry=registry,
        metrics=metrics,
        clock=clock,
        secret=b"s" * 32,
        sessions=sessions,
        router_peer_id="router",
        announce="/ip4/127.0.0.1/tcp/9000/tls/ws",
        heartbeat_interval=5.0,
        max_conns_per_ip=2,
    )
    return control, registry, clock, sessions


def register(control: ControlPlane, sessions: Sessions, peer: str = "peer-a") -> list:  # type: ignore[type-arg]
    grant = sessions.issue(peer)
    holder: list = []  # type: ignore[type-arg]
    reg = Registration(peer_id=peer, model="m", capability="llm", engine="vllm", capacity=2)
    status, _ = control._register(OpenLink(), grant, msgspec.json.encode(reg), holder)  # type: ignore[arg-type]
    assert status == 200
    return holder


def test_routing_signals_never_refresh_liveness() -> None:
    control, registry, clock, sessions = plane()
    holder = register(control, sessions)
    record = registry.get("peer-a")
    assert record is not None
    seen = record.last_heartbeat
    clock.advance(20)
    signal = RoutingSignal(engine=EngineSnapshot(kv_cache_utilization=0.5))
    assert control._signal(holder, msgspec.json.encode(signal))[0] == 200
    assert record.last_heartbeat == seen
    assert record.engine is not None and record.engine.kv_cache_utilization == 0.5
    beat = Heartbeat(backend_healthy=False)
    assert control._heartbeat(holder, msgspec.json.encode(beat))[0] == 200
    assert record.last_heartbeat == seen + 20
    assert not record.eligible  # the backend is down: out of the pool at once


def test_registration_must_match_the_session() -> None:
    control, registry, _, sessions = plane()
    grant = sessions.issue("peer-a")
    reg = Registration(
        peer_id="someone-else", model="m", capability="llm", engine="vllm", capacity=1
    )
    status, _ = control._register(OpenLink(), grant, msgspec.json.encode(reg), [])  # type: ignore[arg-type]
    assert status == 403
    assert registry.get("someone-else") is None


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


def test_oversized_metadata_is_refused() -> None:
    import pytest

    decoder = msgspec.json.Decoder(Registration)
    body = msgspec.json.encode(
        {
            "peer_id": "p",
            "model": "m",
            "capability": "llm",
            "engine": "vllm",
            "capacity": 1,
            "region": "x" * 300,
        }
    )
    with pytest.raises(msgspec.ValidationError):
        decoder.decode(body)
    body = msgspec.json.encode(
        {"peer_id": "p", "model": "m", "capability": "llm", "engine": "vllm", "capacity": 0}
    )
    with pytest.raises(msgspec.ValidationError):
        decoder.decode(body)
