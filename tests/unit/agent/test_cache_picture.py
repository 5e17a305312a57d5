"""The agent's picture of its engine's prefix cache, and the reports it makes of it."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hivenet_router.agent.cache_picture import JOURNAL_BLOCKS, CachePicture, reports
from hivenet_router.domain.agent import (
    MAX_REPORT_BLOCKS,
    CacheReport,
    pack_blocks,
    unpack_blocks,
)
from hivenet_router.routing.prefix import PrefixIndex


def replay(index: PrefixIndex, peer: str, sent: list[CacheReport]) -> None:
    """What a router does with reports (router/routing_state.py, cache_report)."""
    for made in sent:
        report = msgspec.json.decode(msgspec.json.encode(made), type=CacheReport)
        if report.full:
            index.forget(peer)
        for change in report.changes:
            blocks = unpack_blocks(change.blocks)
            if change.held:
                index.hold(peer, blocks)
            else:
                index.drop(peer, blocks)


def test_pack_and_unpack() -> None:
    blocks = (0, -1, 2**63 - 1, -(2**63))
    assert unpack_blocks(pack_blocks(blocks)) == blocks
    for bad in ("not base64!", "AAAA"):
        with pytest.raises(ValueError):
            unpack_blocks(bad)


chains = st.lists(st.lists(st.integers(0, 40), min_size=1, max_size=12), max_size=40)


@settings(max_examples=60, deadline=None)
@given(chains, st.integers(1, 30), st.integers(0, 40))
def test_a_router_following_the_reports_sees_what_the_agent_sees(
    prompts: list[list[int]], capacity_blocks: int, late: int
) -> None:
    """Whether a router follows from the start (deltas) or arrives late (whole picture),
    its index holds exactly the agent's blocks, in the same order."""
    picture = CachePicture(lambda: capacity_blocks * 64)
    follower, latecomer = PrefixIndex(), PrefixIndex()
    position = -1
    for n, prompt in enumerate(prompts):
        # Chains of distinct hashes per prompt, as prompt_blocks makes them.
        picture.served([n * 100 + block for block in dict.fromkeys(prompt)])
        full, changes, position = picture.since(position)
        replay(follower, "a", reports(full, changes))
    full, changes, _ = picture.since(-1)
    assert full
    replay(latecomer, "a", reports(full, changes))
    wanted = picture._index.blocks_of("engine")
    assert follower.blocks_of("a") == wanted == latecomer.blocks_of("a")
    assert len(wanted) <= capacity_blocks


def test_reports_are_bounded_and_a_laggard_gets_the_whole_picture() -> None:
    picture = CachePicture(lambda: 10_000_000.0)
    blocks = list(range(3 * MAX_REPORT_BLOCKS))
    picture.served(blocks[:256])
    start = picture.end
    for n in range(JOURNAL_BLOCKS // 256 + 2):
        picture.served([10**6 * (n + 1) + b for b in range(256)])
    full, changes, _ = picture.since(start)
    assert full  # fell out of the journal
    sent = reports(full, changes)
    assert sent[0].full and not any(r.full for r in sent[1:])
    for report in sent:
        assert sum(len(unpack_blocks(c.blocks)) for c in report.changes) <= MAX_REPORT_BLOCKS
        assert len(msgspec.json.encode(report)) < 64 * 1024
    assert reports(False, []) == []
    assert [r.full for r in reports(True, [])] == [True]


def test_nothing_is_pictured_without_blocks() -> None:
    picture = CachePicture()
    picture.served([])
    assert picture.end == 0 and picture.size() == 0
