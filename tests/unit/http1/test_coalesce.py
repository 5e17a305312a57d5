"""Writes of one event-loop turn sent together, and at once past FLUSH_AT."""

from __future__ import annotations

import asyncio

from hivenet_router.http1.coalesce import FLUSH_AT, TurnWriter


async def test_writes_of_one_turn_are_sent_together_at_its_end() -> None:
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
