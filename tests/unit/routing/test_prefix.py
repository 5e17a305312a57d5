from __future__ import annotations

import tracemalloc
from collections import OrderedDict
from collections.abc import Iterable, Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hivenet_router.routing.prefix import (
    BLOCK_CHARS,
    MAX_BLOCKS,
    PrefixIndex,
    prompt_blocks,
)

LIMIT = BLOCK_CHARS * MAX_BLOCKS


def chain(text: str) -> tuple[int, ...]:
    """One block per character: short strings give long chains that share prefixes."""
    return prompt_blocks([text], block_chars=1, max_blocks=10_000)


def holders_of(index: PrefixIndex) -> dict[int, set[str]]:
    """The shared map with the one-holder form spelled as a set."""
    return {
        block: {holders} if isinstance(holders, str) else set(holders)
        for block, holders in index._holders.items()
    }


def union_of_peers(index: PrefixIndex) -> dict[int, set[str]]:
    union: dict[int, set[str]] = {}
    for peer, record in index._peers.items():
        for block in record.blocks:
            union.setdefault(block, set()).add(peer)
    return union


def assert_consistent(index: PrefixIndex) -> None:
    assert holders_of(index) == union_of_peers(index)
    # A set left with one holder would waste the memory the compact form saves.
    assert all(isinstance(h, str) or len(h) >= 2 for h in index._holders.values())
    assert index.total() == sum(index.size(peer) for peer in index._peers)
    for peer in index._peers:
        assert index.size(peer) <= index.capacity(peer)


# prompt_blocks


def test_equal_prefixes_share_hashes_and_diverge_at_the_first_differing_block() -> None:
    text = "".join(chr(ord("a") + i % 26) for i in range(BLOCK_CHARS * 5))
    changed = text[: BLOCK_CHARS * 2 + 7] + "#" + text[BLOCK_CHARS * 2 + 8 :]
    original, other = prompt_blocks([text]), prompt_blocks([changed])
    assert len(original) == len(other) == 5
    assert original == prompt_blocks([text])
    assert original[:2] == other[:2]
    # The chain carries the difference into every later block, even identical ones.
    assert all(a != b for a, b in zip(original[2:], other[2:], strict=True))


def test_pieces_are_joined_with_newlines() -> None:
    pieces = ["system text", "user", "x" * 700, "assistant", "y" * 300]
    assert prompt_blocks(pieces) == prompt_blocks(["\n".join(pieces)])
    assert prompt_blocks(["ab", "cd"], block_chars=1) == chain("ab\ncd")
    assert prompt_blocks(["ab", "cd"], block_chars=1) != chain("abcd")


def test_a_prompt_shorter_than_a_block_has_no_blocks() -> None:
    assert prompt_blocks([]) == ()
    assert prompt_blocks([""]) == ()
    assert prompt_blocks(["x" * (BLOCK_CHARS - 1)]) == ()
    assert prompt_blocks(["x" * 100, "y" * (BLOCK_CHARS - 102)]) == ()
    assert len(prompt_blocks(["x" * 100, "y" * (BLOCK_CHARS - 101)])) == 1
    # The partial block at the end is left out.
    assert len(prompt_blocks(["x" * (BLOCK_CHARS * 3 - 1)])) == 2


def test_multi_turn_conversations_match_all_earlier_blocks() -> None:
    system = "You are a careful assistant. " * 40
    turns = [system, "user", "first question " * 30]
    index = PrefixIndex()
    earlier: tuple[int, ...] = ()
    for turn in range(6):
        blocks = prompt_blocks(turns)
        assert blocks[: len(earlier)] == earlier
        assert index.match(blocks, ["engine-a", "engine-b"]) == (
            {"engine-a": len(earlier)} if earlier else {}
        )
        index.learn(blocks, "engine-a", now=float(turn))
        earlier = blocks
        turns += ["assistant", f"answer {turn} " * 50, "user", f"question {turn} " * 20]
    assert len(earlier) > 10


def test_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="block_chars"):
        prompt_blocks(["x"], block_chars=0)
    with pytest.raises(ValueError, match="max_blocks"):
        prompt_blocks(["x"], max_blocks=-1)
    assert prompt_blocks(["x" * 1000], max_blocks=0) == ()


def counted(pieces: list[str], seen: list[int]) -> Iterator[str]:
    for piece in pieces:
        seen[0] += 1
        yield piece


def peak_bytes_of_prompt_blocks(pieces: Iterable[str]) -> int:
    tracemalloc.start()
    try:
        prompt_blocks(pieces)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_max_blocks_bounds_a_4_mb_prompt_in_one_piece() -> None:
    prompt = "".join(chr(ord("a") + i % 23) for i in range(1 << 16)) * 64
    assert len(prompt) == 4 << 20
    blocks = prompt_blocks([prompt])
    assert len(blocks) == MAX_BLOCKS
    assert blocks == prompt_blocks([prompt[:LIMIT]])
    # Hashing 64 KiB needs a 64 KiB copy at most, never one of the 4 MiB.
    assert peak_bytes_of_prompt_blocks([prompt]) < 4 * LIMIT


def test_max_blocks_bounds_a_4_mb_prompt_in_10000_pieces() -> None:
    pieces = [f"{i:06d}" + "m" * 413 for i in range(10_000)]
    assert sum(map(len, pieces)) >= 4_000_000
    seen = [0]
    blocks = prompt_blocks(counted(pieces, seen))
    assert len(blocks) == MAX_BLOCKS
    assert blocks == prompt_blocks(["\n".join(pieces)[:LIMIT]])
    # Each piece brings 420 characters with its newline: 157 of them fill the window.
    assert seen[0] == -(-(LIMIT + 1) // 420) == 157
    assert peak_bytes_of_prompt_blocks(pieces) < 4 * LIMIT


def test_only_the_pieces_needed_are_read_when_a_piece_ends_the_window() -> None:
    seen = [0]
    assert len(prompt_blocks(counted(["ab", "c", "de", "fg"], seen), 2, 2)) == 2
    # "ab\nc" is exactly the window: "de" is never pulled.
    assert seen[0] == 2


# PrefixIndex


def test_match_returns_each_peers_longest_prefix() -> None:
    index = PrefixIndex()
    index.learn(chain("abcd"), "a", now=1.0)
    index.learn(chain("abx"), "b", now=2.0)
    index.learn(chain("zz"), "c", now=3.0)
    assert index.match(chain("abcz"), ["a", "b", "c"]) == {"a": 3, "b": 2}
    assert index.match(chain("abcdef"), {"a", "b"}) == {"a": 4, "b": 2}
    assert index.match(chain("abcd"), {"b": 1}.keys()) == {"b": 2}
    assert index.match(chain("q"), ["a", "b", "c"]) == {}
    assert index.match((), ["a"]) == {}
    assert index.last_learned("b") == 2.0
    assert index.last_learned("nobody") is None


def test_match_finds_peers_that_diverge_at_many_depths() -> None:
    index = PrefixIndex()
    text = "abcdefghijklmnopqrstuvwxyz"
    for depth in range(len(text) + 1):
        index.learn(chain(text[:depth] + "#"), f"p{depth}", now=float(depth))
    peers = [f"p{depth}" for depth in range(len(text) + 1)]
    expected = {f"p{depth}": depth for depth in range(1, len(text) + 1)}
    assert index.match(chain(text), peers) == expected
    assert index.match(chain(text + "#"), peers) == expected | {f"p{len(text)}": len(text) + 1}
    assert index.match(chain(text[:5]), peers[3:]) == {"p3": 3, "p4": 4} | {
        f"p{depth}": 5 for depth in range(5, len(text) + 1)
    }


def test_match_ignores_peers_not_in_the_index_and_peers_not_asked_about() -> None:
    index = PrefixIndex()
    index.learn(chain("abc"), "a", now=1.0)
    index.learn(chain("abc"), "b", now=1.0)
    assert index.match(chain("abc"), ["ghost", "other"]) == {}
    assert index.match(chain("abc"), []) == {}
    assert index.match(chain("abc"), ["ghost", "b"]) == {"b": 3}
    assert index.match(chain("abc"), (f"p{i}" for i in range(100))) == {}
    assert index.size("ghost") == 0


def test_lru_eviction_at_capacity_removes_the_tail_of_the_oldest_prompt_first() -> None:
    index = PrefixIndex(default_blocks_per_agent=5)
    index.learn(chain("abc"), "a", now=1.0)
    index.learn(chain("xyz"), "a", now=2.0)
    # Six blocks for a capacity of five: the tail of the older prompt goes, its start stays.
    assert index.size("a") == 5
    assert index.match(chain("abc"), ["a"]) == {"a": 2}
    assert index.match(chain("xyz"), ["a"]) == {"a": 3}
    index.learn(chain("ab"), "a", now=3.0)
    index.learn(chain("k"), "a", now=4.0)
    # "ab" was refreshed, so the older "xyz" lost its tail this time.
    assert index.match(chain("abc"), ["a"]) == {"a": 2}
    assert index.match(chain("xyz"), ["a"]) == {"a": 2}
    assert index.total() == 5 == len(index._holders)
    assert_consistent(index)


def test_evicting_one_peer_leaves_the_shared_blocks_to_the_others() -> None:
    index = PrefixIndex(default_blocks_per_agent=4)
    index.learn(chain("abcd"), "a", now=1.0)
    index.learn(chain("abcd"), "b", now=1.0)
    assert index.total() == 8
    assert len(index._holders) == 4
    assert all(isinstance(h, set) for h in index._holders.values())
    index.learn(chain("wxyz"), "a", now=2.0)
    assert index.match(chain("abcd"), ["a", "b"]) == {"b": 4}
    assert index.total() == 8
    assert len(index._holders) == 8
    # Shared blocks fall back to the one-holder form once "a" let go of them.
    assert {h for block, h in index._holders.items() if block in chain("abcd")} == {"b"}
    index.forget("b")
    assert index.total() == 4
    assert len(index._holders) == 4
    assert_consistent(index)


def test_a_prompt_longer_than_the_capacity_keeps_its_start() -> None:
    index = PrefixIndex(default_blocks_per_agent=3)
    index.learn(chain("abcdefgh"), "a", now=1.0)
    assert index.size("a") == 3
    assert index.match(chain("abcdefgh"), ["a"]) == {"a": 3}
    assert_consistent(index)


def test_set_capacity_evicts_down_to_it_and_applies_to_new_peers() -> None:
    index = PrefixIndex(default_blocks_per_agent=10)
    index.learn(chain("abcdef"), "a", now=1.0)
    index.learn(chain("uvw"), "a", now=2.0)
    index.set_capacity("a", 4)
    assert index.size("a") == 4
    assert index.match(chain("uvw"), ["a"]) == {"a": 3}
    assert index.match(chain("abcdef"), ["a"]) == {"a": 1}
    index.set_capacity("a", 0)
    assert index.size("a") == index.total() == len(index._holders) == 0
    index.learn(chain("abc"), "a", now=3.0)
    assert index.size("a") == 0
    # A peer announced before its first prompt is held to its own capacity from the start.
    index.set_capacity("new", 2)
    index.learn(chain("abcdef"), "new", now=4.0)
    assert index.size("new") == 2
    assert index.capacity("new") == 2
    assert index.capacity("unknown") == 10
    with pytest.raises(ValueError, match="capacity"):
        index.set_capacity("a", -1)
    assert_consistent(index)


def test_forget_leaves_nothing() -> None:
    index = PrefixIndex()
    for peer in ("a", "b", "c"):
        index.learn(chain("shared" + peer * 5), peer, now=1.0)
    for peer in ("a", "b", "c"):
        index.forget(peer)
    index.forget("never-seen")
    assert index.total() == 0
    assert index._holders == {}
    assert len(index) == 0
    assert index.match(chain("shareda"), ["a", "b", "c"]) == {}


def test_the_least_recently_used_agent_makes_room_beyond_max_agents() -> None:
    index = PrefixIndex(max_agents=2)
    index.learn(chain("aaa"), "a", now=1.0)
    index.learn(chain("bbb"), "b", now=2.0)
    index.learn(chain("aaaa"), "a", now=3.0)
    index.learn(chain("ccc"), "c", now=4.0)
    assert set(index._peers) == {"a", "c"}
    assert index.size("b") == 0
    assert index.total() == 7 == len(index._holders)
    assert_consistent(index)


def test_constructor_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="default_blocks_per_agent"):
        PrefixIndex(default_blocks_per_agent=-1)
    with pytest.raises(ValueError, match="max_agents"):
        PrefixIndex(max_agents=0)


# Property: random learn / forget / set_capacity sequences against a plain model.

PEERS = ["p0", "p1", "p2", "p3"]
DEFAULT_CAPACITY = 6
MAX_AGENTS = 3

texts = st.text(alphabet="ab", max_size=9)
operations = st.lists(
    st.one_of(
        st.tuples(st.just("learn"), st.sampled_from(PEERS), texts),
        st.tuples(st.just("forget"), st.sampled_from(PEERS), st.just("")),
        st.tuples(st.just("capacity"), st.sampled_from(PEERS), st.integers(0, 10).map(str)),
    ),
    max_size=40,
)


class Model:
    """The index's intended behaviour, written the slow and obvious way."""

    def __init__(self) -> None:
        self.peers: OrderedDict[str, tuple[list[int], int]] = OrderedDict()

    def admit(self, peer: str) -> None:
        if peer not in self.peers:
            if len(self.peers) >= MAX_AGENTS:
                self.peers.popitem(last=False)
            self.peers[peer] = ([], DEFAULT_CAPACITY)

    def learn(self, blocks: tuple[int, ...], peer: str) -> None:
        self.admit(peer)
        self.peers.move_to_end(peer)
        held, capacity = self.peers[peer]
        for block in reversed(blocks[:capacity]):
            if block in held:
                held.remove(block)
            held.append(block)
        del held[: max(0, len(held) - capacity)]

    def set_capacity(self, peer: str, capacity: int) -> None:
        self.admit(peer)
        held, _ = self.peers[peer]
        del held[: max(0, len(held) - capacity)]
        self.peers[peer] = (held, capacity)


@settings(max_examples=300, deadline=None)
@given(operations)
def test_random_operations_keep_the_index_bounded_and_exact(
    ops: list[tuple[str, str, str]],
) -> None:
    index = PrefixIndex(default_blocks_per_agent=DEFAULT_CAPACITY, max_agents=MAX_AGENTS)
    model = Model()
    learned: list[tuple[int, ...]] = []
    for kind, peer, argument in ops:
        if kind == "learn":
            blocks = chain(argument)
            learned.append(blocks)
            index.learn(blocks, peer, now=0.0)
            model.learn(blocks, peer)
        elif kind == "forget":
            index.forget(peer)
            model.peers.pop(peer, None)
        else:
            index.set_capacity(peer, int(argument))
            model.set_capacity(peer, int(argument))
        assert_consistent(index)
        assert len(index) <= MAX_AGENTS
        assert {p: list(r.blocks) for p, r in index._peers.items()} == {
            p: held for p, (held, _) in model.peers.items()
        }
    for blocks in learned:
        expected: dict[str, int] = {}
        for peer in PEERS:
            held = set(index._peers[peer].blocks) if peer in index._peers else set()
            length = next((i for i, b in enumerate(blocks) if b not in held), len(blocks))
            if length:
                expected[peer] = length
        assert index.match(blocks, PEERS) == expected
