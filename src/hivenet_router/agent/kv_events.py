"""The engine's KV-cache events (vLLM's ZeroMQ publisher, --kv-events-endpoint) keep the
agent's picture of its engine's prefix cache true (agent/cache_picture.py).

The engine names its blocks by hashes of its tokens, which the agent cannot tie to the
routers' hashes of prompt text without the engine's tokenizer. What it can use is how much
the engine evicted: the engine's cache and the picture are both least recently used
first, so when the engine reports N blocks of B tokens removed, the picture drops its
oldest N x B tokens' worth of blocks; when it reports its cache cleared, the picture is
emptied. With events on, the picture no longer evicts by the engine's size on its own
(the engine says when it evicts, and running requests' KV use makes that earlier than
its size alone would), so it is bounded at four times that size instead.
"""

from __future__ import annotations

import asyncio
import logging

import msgspec

from hivenet_router.agent.cache_picture import CachePicture
from hivenet_router.domain.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    decode,
)
from hivenet_router.transport.zmtp import ZmtpError, read_message, subscribe

log = logging.getLogger("hivenet.agent")

RETRY = 1.0  # seconds between attempts to reach the publisher


def apply(picture: CachePicture, batch: EventBatch, block_size: int) -> int:
    """The batch's evictions and resets applied to the picture; the engine's block size,
    as its stored events last said it."""
    for event in batch.events:
        if isinstance(event, BlockStored):
            if event.block_size > 0:
                block_size = event.block_size
        elif isinstance(event, BlockRemoved):
            picture.evicted_tokens(len(event.block_hashes) * block_size)
        elif isinstance(event, AllBlocksCleared):
            picture.clear()
    return block_size


async def follow_forever(picture: CachePicture, host: str, port: int, topic: str) -> None:
    picture.events_driven = True
    block_size = 16
    announced = False
    lost = False  # events were missed: what the picture holds is no longer known
    while True:
        try:
            reader, writer = await subscribe(host, port, topic.encode())
        except (OSError, ZmtpError, asyncio.IncompleteReadError) as exc:
            if not announced:
                log.warning("KV events at tcp://%s:%d unreachable (%s); retrying", host, port, exc)
                announced = True
            await asyncio.sleep(RETRY)
            continue
        if lost:
            # Whatever happened meanwhile went unheard, and a publisher that went away is
            # most often an engine that restarted, empty (vLLM announces no clearing
            # then): the picture starts again from nothing, and the routers hear it.
            picture.clear()
            log.info(
                "KV events at tcp://%s:%d back; the picture of the engine's cache starts "
                "empty (events were missed)",
                host,
                port,
            )
        else:
            log.info("following the engine's KV-cache events at tcp://%s:%d", host, port)
        announced = False
        try:
            while True:
                frames = await read_message(reader)
                if len(frames) < 3:
                    continue
                try:
                    batch = decode(frames[-1])
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    log.debug("KV-event batch skipped: %s", exc)
                    continue
                block_size = apply(picture, batch, block_size)
        except (OSError, ZmtpError, asyncio.IncompleteReadError) as exc:
            log.warning("KV events at tcp://%s:%d lost (%s); reconnecting", host, port, exc)
            lost = True
        finally:
            writer.close()
        await asyncio.sleep(RETRY)
