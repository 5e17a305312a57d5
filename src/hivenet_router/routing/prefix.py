"""An approximate index of the prompt prefixes recently sent to each agent, for prefix affinity.

An engine keeps the KV state of prompts it has served in a prefix cache, in blocks, and a new
prompt that starts the same way skips recomputing those blocks. The router never tokenizes,
so it cuts the prompt text into fixed blocks of characters instead and names each block by a
chained hash: block i's hash covers blocks 0..i, so two prompts share the hash of block i
exactly when (up to hash collisions) their first i + 1 blocks are equal. The chain makes a
flat map from block hash to the agents holding it a radix tree: a hash is a whole path.

Character blocks do not line up with the engine's token blocks, and the index sees only what
this router sent, so a match is an estimate of the cached prefix, good for ranking agents,
not a promise. Everything runs synchronously on the event loop; no locking is needed.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from collections.abc import Set as AbstractSet
from typing import TypeAlias

__all__ = ["BLOCK_CHARS", "MAX_BLOCKS", "PREFIX_CHARS", "PrefixIndex", "prompt_blocks"]

BLOCK_CHARS = 256
"""Characters per block: about 64 tokens of English text or code."""

MAX_BLOCKS = 256
"""Leading blocks hashed at most (64 KiB of text): bounds CPU and memory for megabyte prompts.
A prefix that long already decides where the request should go."""

PREFIX_CHARS = BLOCK_CHARS * MAX_BLOCKS
"""Characters of a prompt (its pieces and the newlines between them) that `prompt_blocks`
reads with the default sizes: what a request's reader needs to keep, and no more."""

_TWO_63, _TWO_64 = 1 << 63, 1 << 64


def prompt_blocks(
    pieces: Iterable[str], block_chars: int = BLOCK_CHARS, max_blocks: int = MAX_BLOCKS
) -> tuple[int, ...]:
    """The chained hashes of the full leading blocks of `pieces` joined with newlines.

    At most `max_blocks` hashes; a trailing partial block has none, since engines cache full
    blocks only. Pieces are read lazily and only until `max_blocks * block_chars` characters
    are in hand, and the last one taken is sliced, so a prompt of megabytes costs no more
    than its first blocks. Block i's hash is the CRC-32 and the Adler-32 of the UTF-8 text
    of blocks 0..i (each continued from the block before), side by side as a signed 64-bit
    integer: the same in every process, so the routers of a site and the agents that
    report their engines' caches (docs/policies.md, Cache reports) name a prefix alike, at
    about twice the cost of Python's per-process `hash` (which a cryptographic hash would
    have made five times).
    """
    if block_chars < 1:
        raise ValueError(f"block_chars must be at least 1, not {block_chars}")
    if max_blocks < 0:
        raise ValueError(f"max_blocks must not be negative, not {max_blocks}")
    limit = block_chars * max_blocks
    if limit == 0:
        return ()
    parts: list[str] = []
    taken = 0
    for index, piece in enumerate(pieces):
        if index:
            parts.append("\n")
            taken += 1
        room = limit - taken
        # Slicing only when needed keeps the common case copy-free; slicing a huge piece
        # copies just the characters that will be hashed.
        parts.append(piece if len(piece) <= room else piece[:room])
        taken += len(parts[-1])
        # Stop here rather than at the top of the loop, so the next piece is never pulled.
        if taken >= limit:
            break
    text = "".join(parts)
    hashes: list[int] = []
    crc, adler = 0, 1
    crc32, adler32 = zlib.crc32, zlib.adler32
    for start in range(0, len(text) - block_chars + 1, block_chars):
        block = text[start : start + block_chars].encode()
        crc, adler = crc32(block, crc), adler32(block, adler)
        value = crc << 32 | adler
        hashes.append(value - _TWO_64 if value >= _TWO_63 else value)
    return tuple(hashes)


class _Peer:
    """One agent's blocks, least recently sent first, and how many its engine can hold."""

    __slots__ = ("blocks", "capacity", "last_learned")

    def __init__(self, capacity: int) -> None:
        self.blocks: OrderedDict[int, None] = OrderedDict()
        self.capacity = capacity
        self.last_learned: float | None = None


# A block held by one agent stores the agent's name rather than a one-element set: with
# affinity routing most blocks live on one agent, and a set costs about ten times a reference.
_Holders: TypeAlias = str | set[str]


def _count(holders: _Holders) -> int:
    return 1 if isinstance(holders, str) else len(holders)


def _holds(holders: _Holders, peer: str) -> bool:
    if isinstance(holders, str):
        return holders == peer
    return peer in holders


class PrefixIndex:
    """Which agents were recently sent which prefixes, for one model.

    Each agent's entries are capped by its capacity (`set_capacity`, else
    `default_blocks_per_agent`) and evicted least recently sent first; at most `max_agents`
    agents are tracked, the one least recently sent a prompt making room for a new one. So
    the index never holds more than the sum of the tracked agents' capacities in entries.

    Invariant: an agent that holds a block also holds the block before it in its chain.
    `learn` refreshes a prompt's blocks from the last to the first, so within an agent a
    block is always more recent than any block that extends it, and least-recently-used
    eviction removes a chain from its tail. The engines' caches evict the same way (vLLM
    frees a request's blocks tail first), which keeps the index in step with them, and
    `match` relies on it to find each agent's longest prefix without checking every block.
    """

    def __init__(
        self,
        default_blocks_per_agent: int = 4096,
        max_agents: int = 4096,
        on_evict: Callable[[str, int], None] | None = None,
    ) -> None:
        if default_blocks_per_agent < 0:
            raise ValueError(
                f"default_blocks_per_agent must not be negative, not {default_blocks_per_agent}"
            )
        if max_agents < 1:
            raise ValueError(f"max_agents must be at least 1, not {max_agents}")
        self._default_capacity = default_blocks_per_agent
        self._max_agents = max_agents
        # Told of every block a peer's capacity pushed out (not of `forget` or `drop`).
        self._on_evict = on_evict
        self._holders: dict[int, _Holders] = {}
        # Least recently sent a prompt first: the end that makes room for a new agent.
        self._peers: OrderedDict[str, _Peer] = OrderedDict()
        self._total = 0

    def match(self, blocks: Sequence[int], peers: Iterable[str]) -> dict[str, int]:
        """How many leading blocks of `blocks` each of `peers` holds (its longest prefix).

        Only peers with a match of at least one block are in the result: a peer missing
        from it, whether unknown to the index or sharing no block, matched 0, so read it
        with `.get(peer, 0)`. Costs O(len(peers) + len(blocks) + m log c) for m matching
        peers, c being the number of depths at which one of the block holders drops out
        (1 when they all share the same prefix), however many peers hold the blocks.
        """
        if not blocks:
            return {}
        first = self._holders.get(blocks[0])
        if first is None:
            return {}
        wanted = peers if isinstance(peers, AbstractSet) else set(peers)
        if isinstance(first, str):
            alive = [first] if first in wanted else []
        elif len(first) <= len(wanted):
            alive = [holder for holder in first if holder in wanted]
        else:
            alive = [holder for holder in wanted if holder in first]
        if not alive:
            return {}
        # By the invariant the holders along the path are nested, each block's within the
        # previous block's, so equal counts mean equal sets: a peer's match can end only
        # where the count changes (a cut) or where the path does. The walk stops at the
        # first block nobody holds, since no deeper block of this prompt is held either.
        path = [first]
        cuts: list[int] = []
        previous = _count(first)
        for block in blocks[1:]:
            holders = self._holders.get(block)
            if holders is None:
                break
            count = _count(holders)
            if count != previous:
                cuts.append(len(path))
                previous = count
            path.append(holders)
        cuts.append(len(path))
        result: dict[str, int] = {}
        for peer in alive:
            # The first cut whose block `peer` lacks; the end of the path always qualifies.
            low, high = 0, len(cuts) - 1
            while low < high:
                middle = (low + high) // 2
                if _holds(path[cuts[middle]], peer):
                    low = middle + 1
                else:
                    high = middle
            result[peer] = cuts[low]
        return result

    def learn(self, blocks: Sequence[int], peer: str, now: float) -> None:
        """Record that `peer` was sent a prompt with these blocks, which its engine now caches.

        The blocks become the peer's most recent, the first block most of all, and the
        peer becomes the most recently used agent. Blocks beyond the peer's capacity are not
        recorded: a cache too small for the prompt keeps its start. Costs O(len(blocks)),
        plus the evictions it causes.
        """
        record = self._peers.get(peer)
        if record is None:
            record = self._admit(peer)
        else:
            self._peers.move_to_end(peer)
        record.last_learned = now
        held = record.blocks
        for index in range(min(len(blocks), record.capacity) - 1, -1, -1):
            block = blocks[index]
            if block in held:
                held.move_to_end(block)
                continue
            held[block] = None
            self._total += 1
            holders = self._holders.get(block)
            if holders is None:
                self._holders[block] = peer
            elif isinstance(holders, str):
                # `holders` is another peer: this one would have had the block in `held`.
                self._holders[block] = {holders, peer}
            else:
                holders.add(peer)
        self._trim(peer, record)

    def hold(self, peer: str, blocks: Iterable[int]) -> None:
        """Record that `peer`'s engine holds these blocks, each becoming its most recent in
        the order given: an agent's report of its engine's cache (the engine's own
        recency order, which keeps the invariant when the engine's cache kept it)."""
        record = self._peers.get(peer)
        if record is None:
            record = self._admit(peer)
        held = record.blocks
        for block in blocks:
            if block in held:
                held.move_to_end(block)
                continue
            held[block] = None
            self._total += 1
            holders = self._holders.get(block)
            if holders is None:
                self._holders[block] = peer
            elif isinstance(holders, str):
                self._holders[block] = {holders, peer}
            else:
                holders.add(peer)
        self._trim(peer, record)

    def touched(self, peer: str, now: float) -> None:
        """`peer` was last known to take a prompt at `now` (what `last_learned` reads)."""
        record = self._peers.get(peer)
        if record is not None:
            record.last_learned = now

    def drop(self, peer: str, blocks: Iterable[int]) -> None:
        """`peer`'s engine evicted these blocks (those it is not known to hold are skipped)."""
        record = self._peers.get(peer)
        if record is None:
            return
        held = record.blocks
        for block in blocks:
            if block in held:
                del held[block]
                self._release(block, peer)

    def blocks_of(self, peer: str) -> list[int]:
        """The blocks held for `peer`, least recent first: what `hold` rebuilds them from."""
        record = self._peers.get(peer)
        return [] if record is None else list(record.blocks)

    def set_capacity(self, peer: str, blocks: int) -> None:
        """How many blocks this peer's engine can hold, from its reported prefix-cache size.

        Entries beyond it are evicted least recently sent first, as the engine evicts. An
        unknown peer is tracked from now on (with no entries), so that its first prompts
        are already held to its real capacity.
        """
        if blocks < 0:
            raise ValueError(f"capacity must not be negative, not {blocks}")
        record = self._peers.get(peer)
        if record is None:
            record = self._admit(peer)
        record.capacity = blocks
        self._trim(peer, record)

    def forget(self, peer: str) -> None:
        """The agent left (or its cache was reset): drop all its entries."""
        record = self._peers.pop(peer, None)
        if record is not None:
            self._drop(peer, record)

    def size(self, peer: str) -> int:
        """Blocks held for `peer`; 0 for a peer not tracked."""
        record = self._peers.get(peer)
        return 0 if record is None else len(record.blocks)

    def capacity(self, peer: str) -> int:
        """The most blocks held for `peer`: its reported capacity, else the default."""
        record = self._peers.get(peer)
        return self._default_capacity if record is None else record.capacity

    def room(self, peer: str) -> int:
        """Blocks the peer's cache can still take before it evicts."""
        return self.capacity(peer) - self.size(peer)

    def last_learned(self, peer: str) -> float | None:
        """The `now` of the last prompt recorded for `peer`, None if none was: a scorer may
        trust an old entry less, since other traffic to the engine may have evicted it."""
        record = self._peers.get(peer)
        return None if record is None else record.last_learned

    def total(self) -> int:
        """Entries (peer, block) held for all peers: the sum of their sizes."""
        return self._total

    def __len__(self) -> int:
        """The number of peers tracked."""
        return len(self._peers)

    def _admit(self, peer: str) -> _Peer:
        if len(self._peers) >= self._max_agents:
            oldest, record = self._peers.popitem(last=False)
            self._drop(oldest, record)
        record = _Peer(self._default_capacity)
        self._peers[peer] = record
        return record

    def _trim(self, peer: str, record: _Peer) -> None:
        held = record.blocks
        evicted = self._on_evict
        while len(held) > record.capacity:
            block, _ = held.popitem(last=False)
            self._release(block, peer)
            if evicted is not None:
                evicted(peer, block)

    def _drop(self, peer: str, record: _Peer) -> None:
        for block in record.blocks:
            self._release(block, peer)
        record.blocks.clear()

    def _release(self, block: int, peer: str) -> None:
        self._total -= 1
        holders = self._holders[block]
        if isinstance(holders, str):
            del self._holders[block]
            return
        holders.discard(peer)
        if len(holders) == 1:
            # Back to the compact form once one holder is left.
            self._holders[block] = next(iter(holders))
