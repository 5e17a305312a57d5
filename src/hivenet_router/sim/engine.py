"""A small model of a continuous-batching engine.

What it models, and why it matters to a router:
- prefill time grows with the prompt tokens that miss the prefix cache, so routing a
  conversation back to the engine that holds its prefix lowers time to first token;
- the prefix cache is an LRU of hashed token blocks, as in vLLM's automatic prefix caching;
- decode slows per sequence as the batch grows;
- at most `max_num_seqs` sequences run; others wait in FIFO order;
- each running sequence holds KV-cache tokens (prompt plus its output budget) out of a fixed
  budget, which is what `vllm:kv_cache_usage_perc` reports;
- the `slowdown` fault multiplies every delay, to play an engine that has become slow.

Tokens are approximated as 4 bytes of UTF-8 text; that is enough for timing and caching.
"""

from __future__ import annotations

import asyncio
import zlib
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from hivenet_router.sim.faults import Faults
from hivenet_router.sim.kv_events import KvEventPublisher

BYTES_PER_TOKEN = 4

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
)
# Tokens per request, as vLLM buckets them (1, 2, 5 and their powers of ten).
TOKEN_BUCKETS = tuple(float(m * 10**e) for e in range(5) for m in (1, 2, 5))
ITL_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
)


def count_tokens(text: bytes) -> int:
    return max(1, -(-len(text) // BYTES_PER_TOKEN))


def block_hashes(text: bytes, block_size: int) -> list[int]:
    """Chained hashes of the full token blocks of a prompt: equal prefixes share hashes."""
    step = block_size * BYTES_PER_TOKEN
    hashes: list[int] = []
    crc = 0
    for start in range(0, len(text) - step + 1, step):
        crc = zlib.crc32(text[start : start + step], crc)
        # The block index keeps equal blocks at different depths apart.
        hashes.append(crc | (len(hashes) << 32))
    return hashes


class PrefixCache:
    """An LRU of token blocks. `match` counts the leading blocks already cached and caches all.
    With `events`, every block stored and evicted is published (sim/kv_events.py)."""

    def __init__(
        self, capacity_blocks: int, block_size: int = 16, events: KvEventPublisher | None = None
    ) -> None:
        self._capacity = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self._block_size = block_size
        self.events = events

    def match(self, hashes: list[int], prompt: bytes = b"") -> int:
        hits = 0
        for block in hashes:
            if block in self._blocks:
                self._blocks.move_to_end(block)
                hits += 1
            else:
                break
        evicted: list[int] = []
        for block in hashes[hits:]:
            self._blocks[block] = None
            if len(self._blocks) > self._capacity:
                evicted.append(self._blocks.popitem(last=False)[0])
        events = self.events
        if events is not None and hits < len(hashes):
            step = self._block_size * BYTES_PER_TOKEN
            text = prompt[hits * step : len(hashes) * step]
            tokens = [int.from_bytes(text[i : i + 4], "big") for i in range(0, len(text), 4)]
            parent = hashes[hits - 1] if hits else None
            events.stored(hashes[hits:], parent, tokens, self._block_size)
            if evicted:
                events.removed(evicted)
        return hits

    def clear(self) -> None:
        """Drop every cached block, as vLLM's POST /reset_prefix_cache does."""
        self._blocks.clear()
        if self.events is not None:
            self.events.cleared()

    def __len__(self) -> int:
        return len(self._blocks)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.total = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.total += 1
        self.sum += value
        for index, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[index] += 1


@dataclass
class EngineStats:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    preemptions: int = 0
    finished: dict[str, int] = field(default_factory=lambda: {"stop": 0, "length": 0, "abort": 0})
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    prompt: Histogram = field(default_factory=lambda: Histogram(TOKEN_BUCKETS))
    generation: Histogram = field(default_factory=lambda: Histogram(TOKEN_BUCKETS))


@dataclass(frozen=True, slots=True)
class Timing:
    ttft_base: float
    prefill_per_token: float
    itl: float
    batch_slowdown: float


@dataclass(slots=True)
class Sequence:
    prompt_tokens: int
    cached_tokens: int
    kv_tokens: int


class Engine:
    """Admission, prefix caching and timing for one simulated engine."""

    def __init__(
        self,
        *,
        max_num_seqs: int,
        kv_cache_tokens: int,
        block_size: int,
        timing: Timing,
        zero_latency: bool,
        faults: Faults | None = None,
        events: KvEventPublisher | None = None,
    ) -> None:
        self.max_num_seqs = max_num_seqs
        self.kv_cache_tokens = kv_cache_tokens
        self.block_size = block_size
        self.timing = timing
        self.zero_latency = zero_latency
        # Shared with the fault admin route and read at every delay, so a slowdown set
        # mid-run applies to the very next prefill or token.
        self.faults = faults if faults is not None else Faults()
        self.cache = PrefixCache(kv_cache_tokens // block_size, block_size, events)
        self.stats = EngineStats()
        self.running = 0
        self.kv_used = 0
        self._waiting: deque[tuple[int, asyncio.Future[None]]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def kv_usage(self) -> float:
        return min(1.0, self.kv_used / self.kv_cache_tokens)

    def _fits(self, kv_tokens: int) -> bool:
        if self.running >= self.max_num_seqs:
            return False
        # A sequence larger than the whole cache still runs alone, as a real engine would
        # after preempting everything else.
        return self.running == 0 or self.kv_used + kv_tokens <= self.kv_cache_tokens

    async def admit(self, prompt: bytes, max_new_tokens: int) -> Sequence:
        """Wait for a batch slot and KV room, then start the sequence. Cancellation-safe."""
        prompt_tokens = count_tokens(prompt)
        kv_tokens = prompt_tokens + max_new_tokens
        if self._waiting or not self._fits(kv_tokens):
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            entry = (kv_tokens, waiter)
            self._waiting.append(entry)
            try:
                await waiter
            except BaseException:
                if entry in self._waiting:
                    self._waiting.remove(entry)
                elif waiter.done() and not waiter.cancelled():
                    # Woken and cancelled in the same step: hand the room to the next one.
                    self.running -= 1
                    self.kv_used -= kv_tokens
                    self._wake()
                raise
        else:
            self.running += 1
            self.kv_used += kv_tokens
        hits = self.cache.match(block_hashes(prompt, self.block_size), prompt)
        cached = min(prompt_tokens, hits * self.block_size)
        self.stats.prompt_tokens += prompt_tokens
        self.stats.prefix_queries += prompt_tokens
        self.stats.prefix_hits += cached
        return Sequence(prompt_tokens, cached, kv_tokens)

    def release(self, seq: Sequence, finish_reason: str, generated: int) -> None:
        self.running -= 1
        self.kv_used -= seq.kv_tokens
        self.stats.generation_tokens += generated
        self.stats.finished[finish_reason] = self.stats.finished.get(finish_reason, 0) + 1
        self.stats.prompt.observe(seq.prompt_tokens)
        self.stats.generation.observe(generated)
        self._wake()

    def _wake(self) -> None:
        while self._waiting and self._fits(self._waiting[0][0]):
            kv_tokens, waiter = self._waiting.popleft()
            if waiter.done():
                continue
            self.running += 1
            self.kv_used += kv_tokens
            waiter.set_result(None)

    def prefill_delay(self, seq: Sequence) -> float:
        if self.zero_latency:
            return 0.0
        uncached = seq.prompt_tokens - seq.cached_tokens
        base = self.timing.ttft_base + uncached * self.timing.prefill_per_token
        return base * self.faults.slowdown

    def token_delay(self) -> float:
        if self.zero_latency:
            return 0.0
        extra = max(0, self.running - 1) * self.timing.batch_slowdown
        return self.timing.itl * (1.0 + extra) * self.faults.slowdown
