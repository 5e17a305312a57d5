"""The in-memory store: TTL on an injected clock, least recently used out first, the byte
bound, and answers too large to keep."""

from __future__ import annotations

import pytest

from hivenet_router.clock import ManualClock
from hivenet_router.gateway.cache_store import (
    ENTRY_OVERHEAD,
    SWEEP_EVERY,
    MemoryStore,
    Stored,
    decode,
    encode,
    storable,
)

BIG = 1 << 30


def answer(clock: ManualClock, data: bytes = b"data: x\n\n") -> Stored:
    return Stored(200, "text/event-stream", True, data, clock.wall())


def test_an_entry_lives_for_its_ttl() -> None:
    clock = ManualClock()
    store = MemoryStore(clock)
    assert store.put("k", answer(clock), 10.0, 100, BIG)
    clock.advance(9.9)
    assert store.get("k") is not None
    clock.advance(0.2)
    assert store.get("k") is None
    assert len(store) == 0 and store.bytes == 0


def test_an_entry_read_from_elsewhere_keeps_only_the_rest_of_its_ttl() -> None:
    clock = ManualClock()
    old = answer(clock)
    clock.advance(8)
    store = MemoryStore(clock)
    assert store.put("k", old, 10.0, 100, BIG)
    clock.advance(2.5)
    assert store.get("k") is None
    assert not store.put("k", old, 10.0, 100, BIG)  # already past its ttl


def test_max_age_skips_an_older_entry_without_dropping_it() -> None:
    clock = ManualClock()
    store = MemoryStore(clock)
    store.put("k", answer(clock), 100.0, 100, BIG)
    clock.advance(20)
    assert store.get("k", max_age=10) is None
    assert store.get("k", max_age=30) is not None


def test_least_recently_used_goes_first() -> None:
    clock = ManualClock()
    store = MemoryStore(clock)
    for name in "abc":
        store.put(name, answer(clock), 100.0, 3, BIG)
    assert store.get("a") is not None  # a is now the most recent
    store.put("d", answer(clock), 100.0, 3, BIG)
    assert store.get("b") is None
    assert all(store.get(name) is not None for name in "acd")
    assert store.evictions == 1


def test_the_byte_bound_holds_and_an_oversize_answer_is_not_kept() -> None:
    clock = ManualClock()
    store = MemoryStore(clock)
    one = answer(clock, b"x" * 1000)
    bound = 2 * one.size + 10
    store.put("a", one, 100.0, 100, bound)
    store.put("b", one, 100.0, 100, bound)
    store.put("c", one, 100.0, 100, bound)
    assert len(store) == 2 and store.bytes == 2 * one.size <= bound
    assert store.get("a") is None
    assert not store.put("huge", answer(clock, b"x" * bound), 100.0, 100, bound)
    assert store.get("huge") is None and len(store) == 2
    assert one.size == 1000 + len("text/event-stream") + ENTRY_OVERHEAD


def test_expired_entries_go_as_the_store_is_written() -> None:
    clock = ManualClock()
    store = MemoryStore(clock)
    store.put("a", answer(clock), 1.0, 100, BIG)
    store.put("b", answer(clock), 100.0, 100, BIG)
    clock.advance(2)
    store.put("c", answer(clock), 100.0, 100, BIG)
    assert len(store) == 2 and store.evictions == 0  # expiries are not evictions
    store.put("d", answer(clock), 1.0, 100, BIG)
    clock.advance(2)
    assert store.sweep() == 1 and len(store) == 2


def test_a_replaced_entry_is_counted_once() -> None:
    clock = ManualClock()
    store = MemoryStore(clock)
    entry = answer(clock)
    store.put("a", entry, 100.0, 100, BIG)
    store.put("a", entry, 100.0, 100, BIG)
    assert len(store) == 1 and store.bytes == entry.size
    store.delete("a")
    assert len(store) == 0 and store.bytes == 0


def test_expired_entries_go_as_the_store_is_used() -> None:
    clock = ManualClock()
    store = MemoryStore(clock)
    for key in "abc":
        store.put(key, answer(clock), 5.0, 100, BIG)
    store.put("long", answer(clock), 300.0, 100, BIG)
    store.get("a")  # recently used: not at the end a write trims from
    clock.advance(SWEEP_EVERY)
    assert store.get("long") is not None
    assert len(store) == 1 and store.bytes == answer(clock).size


def test_the_site_form_of_a_stored_answer_round_trips() -> None:
    good = Stored(200, "application/json", False, b"{}", 1_700_000_000.0)
    assert decode(encode(good)) == good
    assert decode(b"\xff\x00garbage") is None
    wrong_version = bytearray(encode(good))
    wrong_version[1] = 9  # the first field of the msgpack array: the version
    assert decode(bytes(wrong_version)) is None


DONE = b"data: [DONE]\n\n"
STOP = b'event: message_stop\ndata: {"type":"message_stop"}\n\n'


CHAT = "/v1/chat/completions"


@pytest.mark.parametrize(
    ("streamed", "data", "keep"),
    [
        (True, b'data: {"choices":[]}\n\n' + DONE, True),
        (True, b'data: {"choices":[]}\r\n\r\ndata: [DONE]\r\n\r\n', True),
        (True, b'data: {"content":"an \\"error\\" here"}\n\n' + DONE, True),
        (True, b"event: message_start\ndata: {}\n\n" + STOP, True),
        (True, b'data: {"choices":[]}\n\n', False),  # cut before [DONE]
        (True, b"event: message_start\ndata: {}\n\n", False),  # cut before message_stop
        (True, b'data: {"error":{"message":"oom"}}\n\n' + DONE, False),
        (True, b'data: {"\\u0065rror":{"message":"oom"}}\n\n' + DONE, False),  # escaped key
        (True, b'data: {"err\\u006fr":"x"}\n\n' + DONE, False),
        (True, b'event: error\ndata: {"type":"error","error":{}}\n\n' + STOP, False),
        (True, b'data: {"type":"\\u0065rror"}\n\n' + STOP, False),
        (True, b"data: <html>oops</html>\n\n" + DONE, False),  # not JSON
        (True, b'data: {"id":"x","error":null}\n\n' + DONE, True),
        (False, b'{"id":"x","choices":[]}', True),
        (False, b'{"id":"x","error":null,"choices":[]}', True),
        (False, b'{"error":{"message":"overloaded"}}', False),
        (False, b'{"\\u0065rror":{"message":"overloaded"},"choices":[]}', False),
        (False, b'{"type":"error","error":{"type":"overloaded_error"}}', False),
        (False, b'[{"error":1}]', False),  # not an object: not the route's answer
        (False, b"<html><body>502 Bad Gateway</body></html>", False),
        (False, b'{"ok":true}', False),  # JSON, but not a chat completion
        (False, b"", False),
    ],
)
def test_storable_keeps_only_the_routes_whole_success(
    streamed: bool, data: bytes, keep: bool
) -> None:
    assert storable(CHAT, streamed, data) is keep


@pytest.mark.parametrize(
    ("route", "data", "keep"),
    [
        ("/v1/messages", b'{"type":"message","content":[]}', True),
        ("/v1/messages", b'{"choices":[]}', False),
        ("/v1/completions", b'{"choices":[{"text":"x"}]}', True),
        ("/v1/messages/count_tokens", b'{"input_tokens":12}', True),
        ("/v1/messages/count_tokens", b'{"input_tokens":"12"}', False),
        ("/v1/embeddings", b'{"object":"list","data":[]}', True),
        ("/v1/embeddings", b'{"object":"list"}', False),
        ("/v1/rerank", b'{"results":[]}', True),
    ],
)
def test_each_route_has_its_own_success_body(route: str, data: bytes, keep: bool) -> None:
    assert storable(route, False, data) is keep
