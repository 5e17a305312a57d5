from __future__ import annotations

import base64
import logging

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
from hivenet_router.observability.events import Observers
from hivenet_router.router.agent_auth import Sessions
from hivenet_router.router.control import Binding, ControlPlane
from hivenet_router.router.history import HistoryKeeper
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
    registry = Registry()
    sessions = Sessions(clock, 3600)
    control = ControlPlane(
        registry=registry,
        observers=Observers(),
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


async def registered() -> tuple[ControlPlane, Registry, ManualClock, Sessions, Binding, Identity]:
    control, registry, clock, sessions = plane()
    identity = Identity.generate()
    grant = sessions.issue(identity.peer_id)
    binding = Binding(OpenLink(), grant)  # type: ignore[arg-type]
    status, _ = await control.call(binding, "/register", registration(identity, grant))
    assert status == 200
    return control, registry, clock, sessions, binding, identity


async def test_routing_signals_never_refresh_liveness() -> None:
    control, registry, clock, _, binding, identity = await registered()
    record = registry.get(identity.peer_id)
    assert record is not None
    seen = record.last_heartbeat
    clock.advance(20)
    signal = RoutingSignal(engine=EngineSnapshot(kv_cache_utilization=0.5))
    assert (await control.call(binding, "/routing-signals", msgspec.json.encode(signal)))[0] == 200
    assert record.last_heartbeat == seen
    assert record.engine is not None and record.engine.kv_cache_utilization == 0.5
    beat = Heartbeat(backend_healthy=False)
    assert (await control.call(binding, "/heartbeat", msgspec.json.encode(beat)))[0] == 200
    assert record.last_heartbeat == seen + 20
    assert not record.eligible  # the backend is down: out of the pool at once


async def test_registration_must_match_the_session_and_prove_the_peer_id() -> None:
    control, registry, _, sessions = plane()
    identity, other = Identity.generate(), Identity.generate()
    grant = sessions.issue(identity.peer_id)
    binding = Binding(OpenLink(), grant)  # type: ignore[arg-type]
    # someone else's peer ID on this session
    body = registration(other, grant)
    assert (await control.call(binding, "/register", body))[0] == 403
    # the right peer ID, signed by the wrong key
    forged = registration(identity, grant, signature=proof(other, grant))
    assert (await control.call(binding, "/register", forged))[0] == 403
    # a signature over another session's challenge
    stale = registration(identity, grant, signature=proof(identity, sessions.issue("x")))
    assert (await control.call(binding, "/register", stale))[0] == 403
    assert (await control.call(binding, "/register", registration(identity, grant, signature="")))[
        0
    ] == 403
    assert registry.all() == []
    assert (await control.call(binding, "/register", registration(identity, grant)))[0] == 200


async def test_renewal_rebinds_the_connection() -> None:
    control, _registry, _clock, sessions, binding, identity = await registered()
    fresh = sessions.issue(identity.peer_id)
    body = msgspec.json.encode(Renewal(session_token=fresh.token, signature=proof(identity, fresh)))
    assert (await control.call(binding, "/renew", body))[0] == 200
    assert binding.grant is fresh
    # a session of another peer cannot be grafted onto this connection
    thief = Identity.generate()
    theirs = sessions.issue(thief.peer_id)
    body = msgspec.json.encode(Renewal(session_token=theirs.token, signature=proof(thief, theirs)))
    assert (await control.call(binding, "/renew", body))[0] == 403
    body = msgspec.json.encode(Renewal(session_token="forged", signature="AAAA"))
    assert (await control.call(binding, "/renew", body))[0] == 401


async def test_unknown_calls_and_bad_bodies() -> None:
    control, _, _, _, binding, _ = await registered()
    assert (await control.call(binding, "/nope", b"{}"))[0] == 404
    assert (await control.call(binding, "/heartbeat", b"{not json"))[0] == 400
    assert (await control.call(binding, "/heartbeat", b'{"backend_healthy": 3}'))[0] == 400


async def test_an_expired_session_allows_only_renewal() -> None:
    control, _, clock, _, binding, _ = await registered()
    clock.advance(3601)
    assert (await control.call(binding, "/heartbeat", b"{}"))[0] == 401
    assert (await control.call(binding, "/renew", b"{}"))[0] == 400  # reached, then refused


async def test_only_a_registration_new_to_the_router_restores_history() -> None:
    control, registry, _, sessions = plane()
    identity = Identity.generate()
    first = sessions.issue(identity.peer_id)
    binding = Binding(OpenLink(), first)  # type: ignore[arg-type]
    assert (await control.call(binding, "/register", registration(identity, first)))[0] == 200
    assert binding.fresh
    record = registry.get(identity.peer_id)
    assert record is not None
    record.successes = 5
    # The same agent on a new connection: its history rides over in the registry.
    again = sessions.issue(identity.peer_id)
    second = Binding(OpenLink(), again)  # type: ignore[arg-type]
    assert (await control.call(second, "/register", registration(identity, again)))[0] == 200
    assert not second.fresh
    current = registry.get(identity.peer_id)
    assert current is not None and current.successes == 5


async def test_link_upgrades_without_a_session_are_summarised_not_logged_one_by_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Anyone can send them, thousands a second on a few pipelined connections: 16,000
    made 16,000 warnings (found by a new user). One line a minute says how many."""
    from aiohttp.test_utils import make_mocked_request

    control, _, clock, _ = plane()
    caplog.set_level(logging.WARNING, "hivenet.auth")
    for token in ["", "Bearer nope", "Bearer x"] * 100:
        request = make_mocked_request("GET", "/hivenet/link", headers={"Authorization": token})
        assert (await control.accept_link(request)).status == 401
    said = [r.getMessage() for r in caplog.records if "want of a valid session" in r.getMessage()]
    assert len(said) == 1 and ": 1 since" in said[0]
    clock.advance(60)
    request = make_mocked_request("GET", "/hivenet/link", headers={"Authorization": "Bearer x"})
    assert (await control.accept_link(request)).status == 401
    said = [r.getMessage() for r in caplog.records if "want of a valid session" in r.getMessage()]
    assert len(said) == 2 and ": 300 since" in said[1]


def test_an_agent_replacing_its_own_open_connection_again_and_again_is_named(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Two agent processes with one identity file evicted each other forever, and nothing
    said why (found by a new user). A reconnect replaces once; three within a minute are
    said, once a minute while it lasts."""
    control, _, clock, _ = plane()
    caplog.set_level(logging.WARNING, "hivenet.auth")

    def said() -> int:
        return sum("using one identity file" in r.getMessage() for r in caplog.records)

    control._replaced("p")
    clock.advance(30)
    control._replaced("p")
    assert said() == 0  # a reconnect or two
    clock.advance(31)
    control._replaced("p")
    assert said() == 0  # the first one left the window
    for _ in range(10):
        clock.advance(1)
        control._replaced("p")
    assert said() == 1
    clock.advance(60)
    for _ in range(3):
        control._replaced("p")
    assert said() == 2
