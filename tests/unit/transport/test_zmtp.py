"""The ZMTP 3.0 PUB/SUB subset on loopback, carrying vLLM-format KV-event batches."""

from __future__ import annotations

import asyncio

import pytest

from hivenet_router.agent.cache_picture import CachePicture
from hivenet_router.agent.kv_events import apply
from hivenet_router.domain.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    decode,
    encode,
)
from hivenet_router.transport.zmtp import (
    Publisher,
    ZmtpError,
    greeting,
    message,
    read_message,
    subscribe,
)
from tests.ports import free_port


def test_greeting_and_frames() -> None:
    g = greeting()
    assert len(g) == 64 and g[0] == 0xFF and g[9] == 0x7F and g[10:12] == b"\x03\x00"
    assert message([b"a", b"bc"]) == b"\x01\x01a\x00\x02bc"
    assert message([b"x" * 300])[:9] == b"\x02" + (300).to_bytes(8, "big")


async def test_a_subscriber_gets_the_batches_of_its_topic() -> None:
    port = free_port()
    publisher = Publisher()
    await publisher.start("127.0.0.1", port)
    try:
        reader, writer = await subscribe("127.0.0.1", port, b"kv")
        other_reader, other_writer = await subscribe("127.0.0.1", port, b"else")
        while publisher.subscribers < 2 or not all(publisher._subscribers.values()):
            await asyncio.sleep(0.01)
        batch = EventBatch(1.5, [BlockStored([1, 2], None, [7], 16), BlockRemoved([9])])
        publisher.publish([b"kv", (1).to_bytes(8, "big"), encode(batch)])
        publisher.publish([b"kv", (2).to_bytes(8, "big"), encode(EventBatch(2.0, []))])
        topic, seq, payload = await asyncio.wait_for(read_message(reader), 5)
        assert (topic, int.from_bytes(seq, "big")) == (b"kv", 1)
        assert decode(payload) == batch
        assert int.from_bytes((await read_message(reader))[1], "big") == 2
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(read_message(other_reader), 0.2)
        for w in (writer, other_writer):
            w.close()
            await w.wait_closed()
    finally:
        await publisher.close()


async def test_a_non_zmtp_peer_is_refused() -> None:
    port = free_port()

    async def http(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 400 Bad Request\r\n\r\n" + bytes(64))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(http, "127.0.0.1", port)
    try:
        with pytest.raises(ZmtpError):
            await subscribe("127.0.0.1", port)
    finally:
        server.close()
        await server.wait_closed()


def test_evictions_and_resets_shrink_the_picture_oldest_first() -> None:
    picture = CachePicture()
    picture.events_driven = True
    picture.served([1, 2, 3])
    picture.served([4, 5, 6])
    assert picture._index.blocks_of("engine") == [3, 2, 1, 6, 5, 4]
    # 16-token blocks: four of them are one 256-character block of the picture.
    size = apply(
        picture, EventBatch(0, [BlockStored([1], None, [], 16), BlockRemoved([1, 2, 3])]), 0
    )
    assert size == 16 and picture.size() == 6
    apply(picture, EventBatch(0, [BlockRemoved([4, 5, 6, 7, 8])]), size)
    assert picture._index.blocks_of("engine") == [1, 6, 5, 4]
    full, changes, _ = picture.since(0)
    assert not full and changes[-1] == (False, [3, 2])
    apply(picture, EventBatch(0, [AllBlocksCleared()]), size)
    assert picture.size() == 0
