"""Stored answers in this router's memory: least recently used first out, each for its TTL,
the whole store within an entry count and a byte size.

One store per router. Its bounds are the inserting policy's (`max_entries`, `max_bytes`):
with one policy, or policies that agree on them, that is the policy's bound exactly.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from hivenet_router.clock import Clock

# What an entry costs beyond its answer's bytes (the key, the record, the dict slot), so a
# store of many small answers is bounded too.
ENTRY_OVERHEAD = 256


@dataclass(frozen=True, slots=True)
class Stored:
    """A finished answer as it is kept and replayed: a stream's bytes as the client read
    them (`streamed`), or a whole body."""

    status: int
    content_type: str
    streamed: bool
    data: bytes
    created: float  # wall-clock seconds when the answer finished (its age is read from it)

    @property
    def size(self) -> int:
        return len(self.data) + len(self.content_type) + ENTRY_OVERHEAD


@dataclass(slots=True)
class _Slot:
    stored: Stored
    expires: float  # monotonic


class MemoryStore:
    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._slots: OrderedDict[str, _Slot] = OrderedDict()
        self.bytes = 0
        self.evictions = 0  # entries pushed out by the bounds (not expiries)

    def __len__(self) -> int:
        return len(self._slots)

    def get(self, key: str, max_age: float | None = None) -> Stored | None:
        """The live entry under `key`, now the most recently used; an expired one is
        dropped. `max_age` (the request's Cache-Control) skips an older entry but keeps it."""
        slot = self._slots.get(key)
        if slot is None:
            return None
        if slot.expires <= self._clock.monotonic():
            self._drop(key)
            return None
        if max_age is not None and self._clock.wall() - slot.stored.created > max_age:
            return None
        self._slots.move_to_end(key)
        return slot.stored

    def put(self, key: str, stored: Stored, ttl: float, max_entries: int, max_bytes: int) -> bool:
        """Keep `stored` for `ttl` seconds (less its age), then trim to the bounds. False
        when it alone is over `max_bytes` (it is not kept)."""
        if stored.size > max_bytes:
            return False
        remaining = ttl - max(self._clock.wall() - stored.created, 0.0)
        if remaining <= 0:
            return False
        self._drop(key)
        self._slots[key] = _Slot(stored, self._clock.monotonic() + remaining)
        self.bytes += stored.size
        self._trim(max_entries, max_bytes)
        return True

    def delete(self, key: str) -> None:
        self._drop(key)

    def sweep(self) -> int:
        """Drop every expired entry; returns how many (a chore, not on the request path)."""
        now = self._clock.monotonic()
        dead = [key for key, slot in self._slots.items() if slot.expires <= now]
        for key in dead:
            self._drop(key)
        return len(dead)

    def _trim(self, max_entries: int, max_bytes: int) -> None:
        # Over a bound, the least recently used go first; expired entries at that end go
        # too, so a store nobody reads again still empties as it is written to.
        now = self._clock.monotonic()
        while self._slots:
            key, slot = next(iter(self._slots.items()))
            live = slot.expires > now
            if live and len(self._slots) <= max_entries and self.bytes <= max_bytes:
                return
            self.evictions += live
            self._drop(key)

    def _drop(self, key: str) -> None:
        slot = self._slots.pop(key, None)
        if slot is not None:
            self.bytes -= slot.stored.size
