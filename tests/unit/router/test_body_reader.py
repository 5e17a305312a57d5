"""Costly bodies are read by a child process; cheap ones at once; nothing is lost when the
child is killed, retires, or its caller leaves."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import AsyncIterator

import pytest

from hivenet_router.domain.errors import ApiError, ErrorCode
from hivenet_router.router.bodies import parse
from hivenet_router.router.body_reader import BodyReader, BodyWorker, FairTurns

CHAT = "/v1/chat/completions"


def _dense(count: int, model: str = "m") -> bytes:
    head = b'{"model": "' + model.encode() + b'", "max_tokens": 9, "messages": ['
    return head + b",".join([b'{"role": "user", "content": "ab"}'] * count) + b"]}"


@pytest.fixture
async def reader() -> AsyncIterator[BodyReader]:
    made = BodyReader(large=1024, dense=100)
    yield made
    await made.close()
    assert made.worker.pid is None


async def test_a_costly_body_reads_in_the_child_as_it_would_at_once(reader: BodyReader) -> None:
    body = _dense(5_000)
    assert await reader.parse(CHAT, body) == parse(CHAT, body)
    assert reader.worker.started == 1 and reader.worker.pid is not None
    with pytest.raises(ApiError) as refused:
        await reader.parse(CHAT, body[:-1])
    assert refused.value.code == ErrorCode.REQUEST_INVALID
    assert "malformed JSON" in refused.value.message
    with pytest.raises(ApiError, match="max_tokens must be at most"):
        await reader.parse(CHAT, body.replace(b'"max_tokens": 9', b'"max_tokens": 1e12'))
    deep = b'{"model": "m", "x": [' + b"1," * 200 + b"[" * 100_000 + b"]" * 100_000 + b"]}"
    with pytest.raises(ApiError, match="nested too deeply"):
        await reader.parse(CHAT, deep)
    assert reader.worker.started == 1  # one child read them all


async def test_cheap_bodies_never_start_the_child(reader: BodyReader) -> None:
    text = b'{"model": "m", "messages": [{"role": "user", "content": "' + b"a" * 500_000
    facts = await reader.parse(CHAT, text + b'"}]}')
    assert facts.text_bytes == 500_000
    assert (await reader.parse(CHAT, _dense(20))).messages == 20
    assert reader.worker.started == 0


async def test_the_event_loop_runs_while_the_child_reads() -> None:
    reader = BodyReader(large=1024, dense=100)
    body = _dense(300_000)
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0)
            ticks += 1

    await reader.parse(CHAT, _dense(200))  # the child is started and warm
    ticker = asyncio.create_task(tick())
    try:
        before = ticks
        facts = await reader.parse(CHAT, body)
        assert facts.messages == 300_000
        assert ticks > before + 1  # read at once, the loop could not have turned
    finally:
        ticker.cancel()
        await reader.close()


async def test_callers_that_leave_mid_read_leave_the_child_in_step(reader: BodyReader) -> None:
    leaving = [asyncio.create_task(reader.parse(CHAT, _dense(50_000))) for _ in range(3)]
    await asyncio.sleep(0.05)
    for task in leaving:
        task.cancel()
    await asyncio.gather(*leaving, return_exceptions=True)
    for count in (7, 11):  # each gets its own answer, not one meant for a caller gone
        assert (await reader.parse(CHAT, _dense(count * 100))).messages == count * 100
    assert reader.worker.started == 1


async def test_a_killed_child_fails_only_its_body_and_is_replaced(reader: BodyReader) -> None:
    await reader.parse(CHAT, _dense(200))
    pid = reader.worker.pid
    assert pid is not None
    reading = asyncio.create_task(reader.parse(CHAT, _dense(400_000)))
    await asyncio.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(ApiError) as failed:
        await reading
    assert failed.value.code == ErrorCode.REQUEST_TOO_LARGE
    assert (await reader.parse(CHAT, _dense(300))).messages == 300
    assert reader.worker.started == 2 and reader.worker.pid not in (None, pid)


async def test_a_child_dead_while_idle_is_replaced_without_failing_a_body(
    reader: BodyReader,
) -> None:
    await reader.parse(CHAT, _dense(200))
    pid = reader.worker.pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    await asyncio.sleep(0.3)  # the router's event loop sees it end
    assert (await reader.parse(CHAT, _dense(300))).messages == 300
    assert reader.worker.started == 2


async def test_once_closed_bodies_are_read_at_once(reader: BodyReader) -> None:
    await reader.close()
    assert (await reader.parse(CHAT, _dense(300))).messages == 300
    assert reader.worker.started == 0 and reader.worker.pid is None


async def test_a_close_while_the_child_starts_leaves_no_child(reader: BodyReader) -> None:
    asking = asyncio.create_task(reader.parse(CHAT, _dense(300)))
    await asyncio.sleep(0)  # the exchange is starting the child
    await asyncio.sleep(0)
    await reader.close()
    facts_or_error = await asyncio.gather(asking, return_exceptions=True)
    assert reader.worker.pid is None, facts_or_error


async def test_a_child_past_its_memory_bound_retires_after_answering() -> None:
    worker = BodyWorker(retire_rss=1)  # every child is past it
    try:
        for count in (100, 200, 300):
            assert (await worker.parse(CHAT, _dense(count))).messages == count
            assert worker.pid is None  # gone, and waited for
        assert worker.started == 3
    finally:
        await worker.close()


async def test_tenants_take_turns_and_leavers_pass_theirs_on() -> None:
    turns = FairTurns()
    served: list[str] = []

    async def take(who: str, hold: float = 0.0) -> None:
        await turns.acquire(who)
        served.append(who)
        await asyncio.sleep(hold)
        turns.release()

    await turns.acquire("first")  # held while the others line up
    names = ["a1", "a2", "a3", "b1", "c1", "c2"]
    waiting = {name: asyncio.create_task(take(name[0])) for name in names}
    await asyncio.sleep(0)
    assert len(turns) == 6
    waiting["c2"].cancel()  # gives up its place while waiting
    await asyncio.sleep(0)
    assert len(turns) == 5
    turns.release()
    await asyncio.gather(*(task for name, task in waiting.items() if name != "c2"))
    assert served == ["a", "b", "c", "a", "a"]
    assert len(turns) == 0
    await turns.acquire("free")  # free again: taken at once
    turns.release()


async def test_a_waiter_handed_the_turn_as_it_leaves_passes_it_on() -> None:
    turns = FairTurns()
    await turns.acquire("a")
    leaving = asyncio.create_task(turns.acquire("b"))
    staying = asyncio.create_task(turns.acquire("c"))
    await asyncio.sleep(0)
    turns.release()  # handed to b...
    leaving.cancel()  # ...which leaves before it runs
    await asyncio.wait_for(staying, 1.0)  # c gets it
    turns.release()
    assert len(turns) == 0


async def test_one_tenant_s_pile_of_bodies_does_not_hold_back_another_s(reader: BodyReader) -> None:
    done: list[str] = []

    async def read(tenant: str, count: int) -> None:
        await reader.parse(CHAT, _dense(count), tenant)
        done.append(tenant)

    await reader.parse(CHAT, _dense(200))  # the child is running
    pile = [asyncio.create_task(read("flood", 60_000)) for _ in range(4)]
    await asyncio.sleep(0)
    other = asyncio.create_task(read("other", 500))
    await asyncio.gather(*pile, other)
    # The flood's first body was being read and its second was in line before "other"
    # came; its last two wait for "other".
    assert done == ["flood", "flood", "other", "flood", "flood"]


async def test_a_child_that_cannot_start_means_the_body_is_read_at_once(
    reader: BodyReader, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "executable", "/nonexistent/python")
    assert (await reader.parse(CHAT, _dense(300))).messages == 300
    assert reader.worker.pid is None
