"""The registration feed behind GET /admin/registration-stream: what it announces, and that
no subscriber outlives its client or is buffered without bound."""

from __future__ import annotations

import asyncio

import msgspec
import orjson
import pytest

from hivenet_router.clock import ManualClock, run_in_virtual_time
from hivenet_router.domain.agent import Heartbeat, Registration
from hivenet_router.http1.messages import Request, Response, Stream
from hivenet_router.observability.events import Observers
from hivenet_router.router.admin_stream import (
    CLOSING,
    KEEPALIVE_LINE,
    OPENING,
    RegistrationFeed,
)
from hivenet_router.router.health import HealthMonitor
from hivenet_router.router.registry import AgentRecord, Registry
from tests.unit.router.test_control import registered


class Conn:
    """A client connection as a streamed answer sees it. `stuck`: the client has stopped
    reading, so every write parks on a drain that never ends."""

    def __init__(self, stuck: bool = False) -> None:
        self.lost = False
        self.paused = stuck
        self.sent: list[bytes] = []
        self._never: asyncio.Future[None] | None = None

    @property
    def address(self) -> str:
        return "127.0.0.1"

    def write(self, data: bytes) -> None:
        self.sent.append(data)

    def write_or_raise(self, data: bytes) -> None:
        self.sent.append(data)

    def write_soon(self, data: bytes) -> None:
        self.sent.append(data)

    async def drain(self) -> None:
        self._never = asyncio.get_running_loop().create_future()
        await self._never

    @property
    def text(self) -> bytes:
        return b"".join(self.sent)


def stream_request(conn: Conn) -> Request:
    return Request(conn, "GET", "/admin/registration-stream", "", [], body=b"")


def record(peer: str = "peer-a", **fields: object) -> AgentRecord:
    reg = Registration(
        peer_id=peer,
        model="m",
        capability="llm",
        engine="vllm",
        capacity=1,
        deployment_id="deploy-42",
        replica_id="replica-3",
        **fields,  # type: ignore[arg-type]
    )
    return AgentRecord(reg=reg, link=None, last_heartbeat=0.0, registered_at=0.0)


async def settle(predicate: object, rounds: int = 50) -> None:
    """Let other tasks run until `predicate()` holds (bounded)."""
    assert callable(predicate)
    for _ in range(rounds):
        if predicate():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition not met")


def frames(data: bytes) -> list[dict[str, object]]:
    return [orjson.loads(line[6:]) for line in data.split(b"\n") if line.startswith(b"data: ")]


async def test_a_subscriber_receives_changes_and_leaves_nothing_behind() -> None:
    clock = ManualClock()
    feed = RegistrationFeed(clock)
    feed.publish("registered", record())  # nobody listens yet: nothing kept
    conn = Conn()
    task = asyncio.create_task(feed.serve(stream_request(conn)))
    await settle(lambda: feed.subscribers == 1 and conn.sent)
    assert conn.text.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"Content-Type: text/event-stream" in conn.text and OPENING in conn.text
    feed.publish("registered", record())
    feed.publish("unregistered", record())
    await settle(lambda: len(frames(conn.text)) == 2)
    first, second = frames(conn.text)
    assert first == {
        "event_type": "registered",
        "deployment_id": "deploy-42",
        "replica_id": "replica-3",
        "agent_id": "peer-a",
        "timestamp": "2023-11-14T22:13:20.000Z",
        "model": "m",
    }
    assert second["event_type"] == "unregistered"
    task.cancel()  # what the server does when the client goes away
    with pytest.raises(asyncio.CancelledError):
        await task
    assert feed.subscribers == 0 and feed.dropped == 0


def test_silence_is_broken_by_a_keepalive_comment() -> None:
    clock = ManualClock()

    async def main() -> None:
        feed = RegistrationFeed(clock, keepalive=25.0)
        conn = Conn()
        task = asyncio.create_task(feed.serve(stream_request(conn)))
        await settle(lambda: feed.subscribers == 1)
        started = clock.monotonic()
        while KEEPALIVE_LINE not in conn.text and clock.monotonic() - started < 60:
            await asyncio.sleep(1)
        assert KEEPALIVE_LINE in conn.text
        assert 25 <= clock.monotonic() - started <= 27
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert feed.subscribers == 0

    run_in_virtual_time(clock, main())


async def test_a_subscriber_that_stops_reading_is_dropped_not_buffered() -> None:
    feed = RegistrationFeed(ManualClock(), buffer=4)
    conn = Conn(stuck=True)
    request = stream_request(conn)
    task = asyncio.create_task(feed.serve(request))
    await settle(lambda: feed.subscribers == 1)  # parked writing its opening line
    for _ in range(4):
        feed.publish("drained", record())
    assert feed.subscribers == 1 and feed.dropped == 0  # full, not over
    feed.publish("undrained", record())
    assert feed.subscribers == 0 and feed.dropped == 1
    answer = await asyncio.wait_for(task, 1.0)  # ends the stream, not the server's task
    assert isinstance(answer, Stream) and request.close
    feed.publish("drained", record())  # nobody left to hold it
    assert feed.dropped == 1


async def test_shutdown_ends_every_stream_cleanly() -> None:
    feed = RegistrationFeed(ManualClock())
    conns = [Conn(), Conn()]
    tasks = [asyncio.create_task(feed.serve(stream_request(c))) for c in conns]
    await settle(lambda: feed.subscribers == 2)
    feed.publish("registered", record())
    feed.close()
    answers = await asyncio.wait_for(asyncio.gather(*tasks), 1.0)
    for conn, answer in zip(conns, answers, strict=True):
        assert isinstance(answer, Stream)
        assert len(frames(conn.text)) == 1  # what was waiting still went out
        assert conn.text.endswith(CLOSING + b"\r\n")  # its last chunk
    assert feed.subscribers == 0
    late = Conn()  # a stream opened during shutdown ends at once
    assert isinstance(await asyncio.wait_for(feed.serve(stream_request(late)), 1.0), Stream)
    assert late.text.endswith(CLOSING + b"\r\n") and feed.subscribers == 0


async def test_head_opens_no_subscription() -> None:
    feed = RegistrationFeed(ManualClock())
    request = Request(Conn(), "HEAD", "/admin/registration-stream", "", [], body=b"")
    answer = await feed.serve(request)
    assert isinstance(answer, Response) and answer.status == 200
    assert answer.headers["Content-Type"] == "text/event-stream"
    assert feed.subscribers == 0


# -- what the registry and the parts around it announce ----------------------------------------


def heard(registry: Registry) -> list[tuple[str, str]]:
    changes: list[tuple[str, str]] = []
    registry.listen(lambda change, rec: changes.append((change, rec.peer_id)))
    return changes


def test_the_registry_announces_registrations_and_removals() -> None:
    registry = Registry()
    changes = heard(registry)
    registry.upsert(record())
    registry.upsert(record())  # the same peer ID again
    registry.remove("peer-a")
    registry.remove("peer-a")  # already gone: nothing to say
    assert changes == [("registered", "peer-a"), ("updated", "peer-a"), ("unregistered", "peer-a")]


def test_a_failing_listener_does_not_undo_a_registration() -> None:
    registry = Registry()

    def broken(change: str, rec: AgentRecord) -> None:
        raise RuntimeError("boom")

    registry.listen(broken)
    changes = heard(registry)
    registry.upsert(record())
    assert registry.get("peer-a") is not None and changes == [("registered", "peer-a")]


def test_the_health_monitor_announces_silence_once() -> None:
    clock, registry = ManualClock(), Registry()
    changes = heard(registry)
    agent = record()
    agent.last_heartbeat = clock.monotonic()
    registry.upsert(agent)
    monitor = HealthMonitor(
        registry, Observers(), clock, unhealthy_after=15, remove_after=30, on_remove=lambda r: None
    )
    clock.advance(16)
    monitor.sweep()
    monitor.sweep()
    clock.advance(15)
    monitor.sweep()
    assert [c for c, _ in changes] == ["registered", "unhealthy", "unregistered"]


async def test_heartbeats_announce_health_transitions() -> None:
    control, registry, _, _, binding, _ = await registered()
    changes = heard(registry)

    async def beat(backend: bool) -> None:
        body = msgspec.json.encode(Heartbeat(backend_healthy=backend))
        assert (await control.call(binding, "/heartbeat", body))[0] == 200

    await beat(True)  # no change, nothing said
    await beat(False)
    await beat(False)
    await beat(True)
    assert [c for c, _ in changes] == ["unhealthy", "healthy"]
