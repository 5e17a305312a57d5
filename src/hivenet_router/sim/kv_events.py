"""The simulator's KV-cache events, published as vLLM publishes them (`--kv-events-config
'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:PORT"}'`): a
ZeroMQ PUB socket on --kv-events-port sending, for every batch of events, the frames
[topic, 8-byte big-endian sequence number, msgpack batch] (domain/kv_events.py).

Events gather as the prefix cache changes and leave together at the next turn of the
event loop. The block hashes are the simulator's own (vLLM's are its own too: a
subscriber cannot map them to prompt text without the engine's tokenizer), and each
stored block's token_ids are its four-byte groups read as integers, where vLLM sends its
tokens.
"""

from __future__ import annotations

import asyncio
import time

from hivenet_router.domain.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KvEvent,
    encode,
)
from hivenet_router.transport.zmtp import Publisher


class KvEventPublisher:
    def __init__(self, topic: str = "") -> None:
        self.topic = topic.encode()
        self.publisher = Publisher()
        self.sequence = 0
        self._pending: list[KvEvent] = []
        self._scheduled = False

    async def start(self, host: str, port: int) -> None:
        await self.publisher.start(host, port)

    def stored(self, hashes: list[int], parent: int | None, tokens: list[int], size: int) -> None:
        self._add(BlockStored(hashes, parent, tokens, size, None, "GPU"))

    def removed(self, hashes: list[int]) -> None:
        pending = self._pending
        if pending and isinstance(pending[-1], BlockRemoved):
            pending[-1].block_hashes.extend(hashes)
        else:
            self._add(BlockRemoved(hashes, "GPU"))

    def cleared(self) -> None:
        self._add(AllBlocksCleared())

    def _add(self, event: KvEvent) -> None:
        self._pending.append(event)
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        self._scheduled = False
        if not self._pending:
            return
        batch = EventBatch(time.time(), self._pending)
        self._pending = []
        self.sequence += 1
        self.publisher.publish([self.topic, self.sequence.to_bytes(8, "big"), encode(batch)])

    async def close(self) -> None:
        await self.publisher.close()
