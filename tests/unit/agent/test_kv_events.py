"""The agent following its engine's KV-cache events (agent/kv_events.py)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from hivenet_router.agent import kv_events
from hivenet_router.agent.cache_picture import CachePicture
from hivenet_router.transport.zmtp import Publisher
from tests.ports import free_port


async def test_events_missed_while_the_publisher_was_away_empty_the_picture(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A publisher that went away is most often an engine that restarted empty, without
    saying so: once the agent reads its events again, its picture starts from nothing
    (found by a new user: routers kept sending a conversation to an emptied engine)."""
    monkeypatch.setattr(kv_events, "RETRY", 0.01)
    port = free_port()
    picture = CachePicture(lambda: 65_536.0)
    publisher = Publisher()
    await publisher.start("127.0.0.1", port)
    follow = asyncio.create_task(kv_events.follow_forever(picture, "127.0.0.1", port, ""))
    try:
        async with asyncio.timeout(10):
            while publisher.subscribers == 0:
                await asyncio.sleep(0.01)
            picture.served([11, 12, 13])
            await asyncio.sleep(0.05)
            assert picture.size() == 3  # a connection that came up first clears nothing
            await publisher.close()
            await asyncio.sleep(0.05)
            assert picture.size() == 3  # while away, the picture is what it was
            publisher = Publisher()
            await publisher.start("127.0.0.1", port)
            while publisher.subscribers == 0:
                await asyncio.sleep(0.01)
            while picture.size():
                await asyncio.sleep(0.01)
        whole, changes, _ = picture.since(0)  # what the routers are told
        assert not whole and changes[-1][0] is False
        assert sorted(changes[-1][1]) == [11, 12, 13]
    finally:
        follow.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await follow
        await publisher.close()
