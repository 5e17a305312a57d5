"""vLLM's KV-cache events as they travel (msgpack over a ZeroMQ PUB socket; see
transport/zmtp.py): what the simulator publishes and the agent reads.

A batch is an array `[ts, events]` (vLLM may add a data-parallel rank after them); each
event is an array whose first element names its kind: `["BlockStored", block_hashes,
parent_block_hash, token_ids, block_size, lora_id, medium]`, `["BlockRemoved",
block_hashes, medium]`, `["AllBlocksCleared"]`. Trailing fields an older vLLM does not
send (medium) are optional here; unknown kinds fail to decode and the batch is skipped.
"""

from __future__ import annotations

import msgspec


class _Event(msgspec.Struct, array_like=True, tag=True, omit_defaults=True, gc=False):
    pass


class BlockStored(_Event):
    block_hashes: list[int]
    parent_block_hash: int | None = None
    token_ids: list[int] = msgspec.field(default_factory=list)
    block_size: int = 16
    lora_id: int | None = None
    medium: str | None = None


class BlockRemoved(_Event):
    block_hashes: list[int]
    medium: str | None = None


class AllBlocksCleared(_Event):
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[KvEvent]
    data_parallel_rank: int | None = None


encode = msgspec.msgpack.Encoder().encode
decode = msgspec.msgpack.Decoder(EventBatch).decode
