"""The router's side of agents that serve every router of a site: its router ID and the
site's routers in the authentication answer and in every heartbeat reply, and routing that
reads the agent's in-flight total from all routers next to its own exact slot count."""

from __future__ import annotations

import msgspec
import orjson
import pytest

from hivenet_router.clock import ManualClock
from hivenet_router.domain.agent import Heartbeat, Registration
from hivenet_router.router.agent_auth import AgentAuthenticator, Sessions
from hivenet_router.router.registry import AgentRecord
from hivenet_router.transport import trust
from tests.unit.router.test_control import registered

SECRET = b"k" * 48
SITE = [
    {"router_id": "r0", "peer_id": "p", "addr": "10.0.0.1:50051"},
    {"router_id": "r1", "peer_id": "p", "addr": "10.0.0.2:50051"},
]


def record(capacity: int = 2) -> AgentRecord:
    reg = Registration(peer_id="a", model="m", capability="llm", engine="vllm", capacity=capacity)
    return AgentRecord(reg=reg, link=None, last_heartbeat=0.0, registered_at=0.0)


def test_the_authentication_answer_names_the_router_and_its_site() -> None:
    clock = ManualClock()
    auth = AgentAuthenticator(
        secret=SECRET,
        sessions=Sessions(clock, 3600),
        clock=clock,
        router_peer_id="p",
        announce="/ip4/10.0.0.1/tcp/9000/tls/ws",
        heartbeat_interval=5.0,
        renew_margin=300.0,
        failure_limit=5,
        router_id="r0",
        site_routers=lambda: SITE,
    )
    request = orjson.dumps({"token": trust.agent_token(SECRET, "agent", clock.wall())})
    status, answer = auth.answer(request, "10.0.0.9")
    assert status == 200
    assert answer["router_id"] == "r0" and answer["routers"] == SITE


async def test_every_heartbeat_reply_lists_the_site_and_stores_the_total() -> None:
    control, registry, _, _, binding, identity = await registered()
    control.site_routers = lambda: SITE
    agent = registry.get(identity.peer_id)
    assert agent is not None

    async def beat(**fields: object) -> dict[str, object]:
        body = msgspec.json.encode(Heartbeat(backend_healthy=True, **fields))  # type: ignore[arg-type]
        status, reply = await control.call(binding, "/heartbeat", body)
        assert status == 200
        return reply

    assert await beat(inflight_total=2) == {"ok": True, "routers": SITE}
    assert agent.reported == 2 and agent.active == 2 and agent.held == 0
    # An agent that says nothing (older, or serving this router alone) resets it.
    await beat(active_requests=7)
    assert agent.reported == 0 and agent.active == 0
    status, _ = await control.call(
        binding, "/heartbeat", b'{"backend_healthy":true,"inflight_total":-1}'
    )
    assert status == 400


def test_routing_reads_the_larger_of_the_report_and_its_own_slots() -> None:
    agent = record(capacity=2)
    assert agent.try_acquire()
    agent.reported = 0
    assert agent.active == 1  # its own slot, before any report counts it
    agent.reported = 2  # another router holds the other slot
    assert agent.active == 2 and agent.load == 1.0
    assert not agent.try_acquire()  # full: the capacity check reads the combined count
    assert agent.held == 1 and agent.rejected == 1
    agent.reported = 1  # the report is behind: its own count still stands
    assert agent.active == 1 and agent.try_acquire() and agent.held == 2


def test_its_own_slots_stay_exact_whatever_the_agent_reports() -> None:
    agent = record(capacity=3)
    assert agent.try_acquire() and agent.try_acquire()
    agent.reported = 3
    agent.release()
    agent.release()
    assert agent.held == 0 and agent.active == 3  # the report stands until the next one
    with pytest.raises(RuntimeError):
        agent.release()  # never below zero, however high the report
    agent.reported = 0
    assert agent.active == 0


def test_a_reconnect_carries_the_report_with_the_slots() -> None:
    old, new = record(), record()
    assert old.try_acquire()
    old.reported = 2
    new.carry(old)
    assert (new.held, new.reported, new.active) == (1, 2, 2)
