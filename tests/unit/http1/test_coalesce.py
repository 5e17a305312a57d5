"""Writes of one event-loop turn sent together, at once past FLUSH_AT or MAX_WAIT."""

from __future__ import annotations

import asyncio
import math
import time

import pytest

from hivenet_router.http1 import coalesce
from hivenet_router.http1.coalesce import FLUSH_AT, TurnWriter


async def test_writes_of_one_turn_are_sent_together_at_its_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(coalesce, "MAX_WAIT", math.inf)  # however slow the machine
    sent: list[bytes] = []
    writer = TurnWriter(asyncio.get_running_loop(), sent.append)
    for piece in (b"a", b"b", b"c"):
        writer.add(piece)
    assert sent == [] and writer.pending
    await asyncio.sleep(0)
    assert sent == [b"abc"] and not writer.pending
    writer.add(b"d")
    writer.flush()  # an owner that must write now (an end, a close) flushes first
    assert sent == [b"abc", b"d"]
    writer.add(b"e")
    writer.now(b"f")  # a whole answer goes behind the queued piece, in the same write
    writer.now(b"g")
    assert sent == [b"abc", b"d", b"ef", b"g"]
    await asyncio.sleep(0)
    assert sent == [b"abc", b"d", b"ef", b"g"]  # the turn's end finds nothing more


async def test_a_burst_goes_at_once_and_a_dropped_queue_never() -> None:
    sent: list[bytes] = []
    writer = TurnWriter(asyncio.get_running_loop(), sent.append)
    writer.add(b"x")
    writer.add(b"y" * FLUSH_AT)
    assert sent == [b"x" + b"y" * FLUSH_AT]  # backpressure sees it without delay
    writer.add(b"lost")
    writer.drop()  # the connection went away
    await asyncio.sleep(0)
    writer.add(b"late")
    writer.flush()
    assert len(sent) == 1


async def test_a_write_that_finds_the_queue_old_sends_it_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A long turn (a burst of requests handled back to back) must not hold the first
    # one's frame until the last is handled.
    sent: list[bytes] = []
    writer = TurnWriter(asyncio.get_running_loop(), sent.append)
    monkeypatch.setattr(coalesce, "MAX_WAIT", 0.0)
    writer.add(b"first")
    assert sent == []  # alone in the queue, it waits for company or the turn's end
    writer.add(b"second")
    assert sent == [b"firstsecond"] and not writer.pending
    writer.add(b"third")
    monkeypatch.setattr(coalesce, "MAX_WAIT", math.inf)
    writer.add(b"fourth")
    assert sent == [b"firstsecond"]
    await asyncio.sleep(0)
    assert sent == [b"firstsecond", b"thirdfourth"]


async def test_the_wait_is_measured_from_the_oldest_queued_write() -> None:
    sent: list[bytes] = []
    writer = TurnWriter(asyncio.get_running_loop(), sent.append)
    writer.add(b"a")
    time.sleep(coalesce.MAX_WAIT * 2)  # the loop's turn goes on, busy elsewhere
    writer.add(b"b")
    assert sent == [b"ab"]
    writer.add(b"c")  # a fresh queue: its clock starts now
    await asyncio.sleep(0)
    assert sent == [b"ab", b"c"]
