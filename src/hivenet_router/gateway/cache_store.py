"""Stored answers in this router's memory: least recently used first out, each for its TTL,
the whole store within an entry count and a byte size.

One store per router. Its bounds are the inserting policy's (`max_entries`, `max_bytes`):
with one policy, or policies that agree on them, that is the policy's bound exactly.
Expired entries go as the store is used: at most once every SWEEP_EVERY seconds, a read or
a write drops them all (a pass over the entries, amortised over that time).

`encode` and `decode` are a stored answer's form in the site store (msgpack, versioned).
`storable` says whether a 200 answer is one to keep: one that parses as the route's success
(a stream that ended with its terminal event and carries no error event, a body that is the
route's JSON object), read as JSON, not searched as bytes. (The gateway may not
import the relay's own check, so it has this one.)
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Final

import msgspec
import orjson

from hivenet_router.clock import Clock

# What an entry costs beyond its answer's bytes (the key, the record, the dict slot), so a
# store of many small answers is bounded too.
ENTRY_OVERHEAD = 256
VERSION: Final = 1  # of a stored answer's form in the site store
SWEEP_EVERY: Final = 30.0  # seconds between two passes that drop expired entries
# A stream's last event sits in its last bytes; an event is far shorter than this.
_TAIL: Final = 1024


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


class _Entry(msgspec.Struct, array_like=True):
    version: int
    status: int
    content_type: str
    streamed: bool
    created_ms: int
    data: bytes


def encode(stored: Stored) -> bytes:
    return msgspec.msgpack.encode(
        _Entry(
            VERSION,
            stored.status,
            stored.content_type,
            stored.streamed,
            int(stored.created * 1000),
            stored.data,
        )
    )


def decode(raw: bytes) -> Stored | None:
    """The stored answer, or None for a value that is malformed or of another version."""
    try:
        entry = msgspec.msgpack.decode(raw, type=_Entry)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    if entry.version != VERSION or not 100 <= entry.status <= 599:
        return None
    return Stored(
        entry.status, entry.content_type, entry.streamed, entry.data, entry.created_ms / 1000
    )


class MemoryStore:
    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._slots: OrderedDict[str, _Slot] = OrderedDict()
        self.bytes = 0
        self.evictions = 0  # entries pushed out by the bounds (not expiries)
        self._sweep_at = clock.monotonic() + SWEEP_EVERY

    def __len__(self) -> int:
        return len(self._slots)

    def get(self, key: str, max_age: float | None = None) -> Stored | None:
        """The live entry under `key`, now the most recently used; an expired one is
        dropped. `max_age` (the request's Cache-Control) skips an older entry but keeps it."""
        self._chore()
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
        self._chore()
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

    def _chore(self) -> None:
        now = self._clock.monotonic()
        if now >= self._sweep_at:
            self._sweep_at = now + SWEEP_EVERY
            self.sweep()

    def sweep(self) -> int:
        """Drop every expired entry; returns how many (reads and writes do it every
        SWEEP_EVERY seconds)."""
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


# What each route's success body has, beyond being a JSON object with no error in it: an
# HTML page or a stand-in's `{"ok": true}` under a 200 is no answer to replay.
_SUCCESS: Final[dict[str, tuple[str, type]]] = {
    "/v1/chat/completions": ("choices", list),
    "/v1/completions": ("choices", list),
    "/v1/messages": ("content", list),
    "/v1/messages/count_tokens": ("input_tokens", int),
    "/v1/embeddings": ("data", list),
    "/v1/rerank": ("results", list),
}


def storable(route: str, streamed: bool, data: bytes) -> bool:
    """Is this 200 answer the route's success, whole? Parsed, never grepped: a key written
    with a JSON escape (`{"\\u0065rror": ...}`) is the same key.

    A stream must end with its terminal event (OpenAI's `data: [DONE]`, Anthropic's
    `event: message_stop`), carry no error event (an `event: error`, or a data line whose
    JSON object has an "error" or is of type "error": vLLM's in-band failure), and every
    other data line must be a JSON object. A body must be a JSON object with no error and
    with the route's own member (`choices` for chat and completions, `content` for
    messages, ...)."""
    if streamed:
        return _finished(data) and _events_clean(data)
    parsed = _object(data)
    if parsed is None or _is_error(parsed):
        return False
    member = _SUCCESS.get(route)
    return member is None or isinstance(parsed.get(member[0]), member[1])


def _fields(block: bytes) -> list[tuple[bytes, bytes]]:
    """An SSE event block's lines as (field, value) pairs."""
    out = []
    for line in block.splitlines():
        name, _, value = line.partition(b":")
        out.append((name.strip(), value.strip()))
    return out


def _finished(data: bytes) -> bool:
    tail = data[-_TAIL:].replace(b"\r\n", b"\n").rstrip()
    last = tail.rsplit(b"\n\n", 1)[-1]  # the last event
    return any(
        (name == b"data" and value == b"[DONE]") or (name == b"event" and value == b"message_stop")
        for name, value in _fields(last)
    )


def _events_clean(data: bytes) -> bool:
    for name, value in _fields(data):
        if name == b"event" and value == b"error":
            return False
        if name == b"data" and value != b"[DONE]":
            parsed = _object(value)
            if parsed is None or _is_error(parsed):
                return False
    return True


def _object(raw: bytes) -> dict[str, object] | None:
    try:
        parsed = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    return parsed if isinstance(parsed, dict) else None


def _is_error(parsed: dict[str, object]) -> bool:
    return parsed.get("error") is not None or parsed.get("type") == "error"
