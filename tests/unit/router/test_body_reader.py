"""Costly bodies are read by a child process; cheap ones at once; nothing is lost when the
child is killed, retires, or its caller leaves."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator

import pytest

from hivenet_router.domain.errors import ApiError, ErrorCode
from hivenet_router.router.bodies import parse
from hivenet_router.router.body_reader import BodyReader, BodyWorker

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


async def test_a_child_past_its_memory_bound_retires_after_answering() -> None:
    worker = BodyWorker(retire_rss=1)  # every child is past it
    try:
        for count in (100, 200, 300):
            assert (await worker.parse(CHAT, _dense(count))).messages == count
            assert worker.pid is None  # gone, and waited for
        assert worker.started == 3
    finally:
        await worker.close()
