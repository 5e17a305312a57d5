"""Reading the store's replies: anything unexpected is a BadReply, never a value."""

from __future__ import annotations

import pytest

from hivenet_router.sync import store
from hivenet_router.sync.store import BadReply, Keys


def test_a_reply_from_another_script_version_is_refused_by_name() -> None:
    with pytest.raises(BadReply, match="script version"):
        store.tagged([b"hivenet-sync-1", 5, 0, 0], "grant", 4)
    assert store.tagged([store.SCRIPT_TAG, 5, 0, 0], "grant", 4)[1] == 5


@pytest.mark.parametrize(
    "reply", [None, b"OK", [store.SCRIPT_TAG, 1], {"a": 1}, [b"x", b"y", b"z", b"w"]]
)
def test_replies_of_the_wrong_shape_are_refused(reply: object) -> None:
    with pytest.raises(BadReply):
        store.tagged(reply, "grant", 4)


@pytest.mark.parametrize("value", [b"12x", "", None, 1.5, True, [1]])
def test_integers_must_be_integers(value: object) -> None:
    with pytest.raises(BadReply):
        store.as_int(value, "held")


def test_field_lists_and_streams_in_both_protocol_shapes() -> None:
    assert store.pairs([b"a", b"1", b"b", b"2"], "h") == {b"a": b"1", b"b": b"2"}
    assert store.pairs({b"a": b"1"}, "h") == {b"a": b"1"}
    with pytest.raises(BadReply):
        store.pairs([b"a"], "h")
    entry = [b"1-0", [b"r", b"x", b"u", b"{}"]]
    resp2 = [[b"hivenet:{s}:usage", [entry]]]
    resp3 = {b"hivenet:{s}:usage": [[entry]]}
    expected = [(b"1-0", {b"r": b"x", b"u": b"{}"})]
    assert store.stream_entries(resp2) == expected
    assert store.stream_entries(resp3) == expected
    assert store.stream_entries(None) == []
    with pytest.raises(BadReply):
        store.stream_entries([[b"k", [[b"1-0"]]]])


def test_every_key_of_a_site_shares_one_hash_tag() -> None:
    keys = Keys("site-a")
    names = [
        keys.routers, keys.meta, keys.usage, keys.pools,
        keys.pool("org/model:7b"), keys.day("2026-12-01", "tenant\x00model"),
    ]  # fmt: skip
    assert all(name.startswith("hivenet:{site-a}:") for name in names)
    assert keys.day("2026-12-01", "tenant\x00model").endswith("tenant%00model")
    assert keys.pool("org/model:7b").endswith("org%2Fmodel%3A7b")
