"""The prompt-prefix blocks the agent's engine is likely to hold, told to every router.

Each router sends with a forwarded prompt its prefix block hashes (the `x-hivenet-prefix`
header, from `routing.prefix.prompt_blocks`: the same hashes in every router process).
The agent records the blocks of every prompt its engine accepted in an index of its own,
bounded by the engine's prefix-cache size and evicted least recently used first as the
engine evicts, and keeps a journal of what changed: blocks that became the most recent,
blocks evicted. Each router session sends the journal since its last report (whole
pictures when it is new or fell behind the journal), at most one report per
REPORT_GAP seconds and MAX_REPORT_BLOCKS blocks per report (agent/connection.py), so
every router of a site ranks agents by what their engines hold, whoever sent it, with no
store traffic per request.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

from hivenet_router.agent.monitor import Pulse
from hivenet_router.domain.agent import (
    MAX_REPORT_BLOCKS,
    CacheChange,
    CacheReport,
    pack_blocks,
)
from hivenet_router.routing.prefix import BLOCK_CHARS, PrefixIndex

# Characters per token, as the router counts them when it sizes its own index.
CHARS_PER_TOKEN = 4
# The journal's size in blocks: a session further behind gets the whole picture again.
JOURNAL_BLOCKS = 65536
REPORT_GAP = 0.25
EVENTS_SLACK = 4
ENGINE = "engine"  # the index's one peer

Change = tuple[bool, list[int]]


def _no_size() -> float | None:
    return None


class CachePicture:
    def __init__(self, cache_tokens: Callable[[], float | None] = _no_size) -> None:
        self._cache_tokens = cache_tokens
        self._index = PrefixIndex(max_agents=1, on_evict=self._evicted)
        self._journal: deque[Change] = deque()
        self._journal_blocks = 0
        self._start = 0  # the position of the journal's first change
        self.changed = Pulse()
        # Set when the engine's KV events say what it evicts (agent/kv_events.py): the
        # picture then evicts on their word, bounded at EVENTS_SLACK times the engine's size.
        self.events_driven = False
        self._owed = 0.0  # evicted tokens not yet a whole block of the picture

    @property
    def end(self) -> int:
        """The position after the journal's last change."""
        return self._start + len(self._journal)

    def size(self) -> int:
        return self._index.size(ENGINE)

    def served(self, blocks: Sequence[int]) -> None:
        """The engine accepted a prompt with these prefix blocks: it now caches them."""
        if not blocks:
            return
        tokens = self._cache_tokens()
        held = int(tokens * CHARS_PER_TOKEN) // BLOCK_CHARS if tokens else 0
        if self.events_driven:
            held *= EVENTS_SLACK
        if held > 0 and held != self._index.capacity(ENGINE):
            self._index.set_capacity(ENGINE, held)
        chain = list(blocks[: self._index.capacity(ENGINE)])
        if not chain:
            return
        # `learn` refreshes a chain from its last block to its first: that is the order in
        # which they become the most recent, and evictions it causes follow it.
        self._append(True, chain[::-1])
        self._index.learn(chain, ENGINE, 0.0)
        self.changed.notify()

    def evicted_tokens(self, tokens: int) -> None:
        """The engine evicted this many tokens of its cache: the oldest blocks go."""
        self._owed += tokens * CHARS_PER_TOKEN / BLOCK_CHARS
        count = int(self._owed)
        if count <= 0:
            return
        self._owed -= count
        self._dropped(self._index.blocks_of(ENGINE)[:count])

    def clear(self) -> None:
        """The engine emptied its cache."""
        self._owed = 0.0
        self._dropped(self._index.blocks_of(ENGINE))

    def _dropped(self, blocks: list[int]) -> None:
        if not blocks:
            return
        self._index.drop(ENGINE, blocks)
        self._append(False, blocks)
        self.changed.notify()

    def since(self, position: int) -> tuple[bool, list[Change], int]:
        """What changed after `position`: (whole picture?, changes, the new position). A
        position before the journal (a new session, one that fell behind) gets the whole
        picture, least recent block first."""
        end = self.end
        if position < self._start:
            return True, [(True, self._index.blocks_of(ENGINE))], end
        changes = list(self._journal)[position - self._start :]
        return False, changes, end

    def _evicted(self, peer: str, block: int) -> None:
        journal = self._journal
        if journal and not journal[-1][0]:
            journal[-1][1].append(block)
            self._journal_blocks += 1
        else:
            self._append(False, [block])
        self._trim()

    def _append(self, held: bool, blocks: list[int]) -> None:
        self._journal.append((held, blocks))
        self._journal_blocks += len(blocks)
        self._trim()

    def _trim(self) -> None:
        journal = self._journal
        while self._journal_blocks > JOURNAL_BLOCKS and len(journal) > 1:
            _, blocks = journal.popleft()
            self._journal_blocks -= len(blocks)
            self._start += 1


def reports(full: bool, changes: list[Change]) -> list[CacheReport]:
    """The changes as reports of at most MAX_REPORT_BLOCKS blocks each; a whole picture's
    first report says so. No change at all is one empty report only for a whole picture."""
    out: list[CacheReport] = []
    current = CacheReport(full=full)
    room = MAX_REPORT_BLOCKS
    for held, blocks in changes:
        for start in range(0, len(blocks), MAX_REPORT_BLOCKS):
            piece = blocks[start : start + MAX_REPORT_BLOCKS]
            if len(piece) > room or len(current.changes) >= MAX_REPORT_BLOCKS:
                out.append(current)
                current, room = CacheReport(), MAX_REPORT_BLOCKS
            current.changes.append(CacheChange(held, pack_blocks(piece)))
            room -= len(piece)
    if current.changes or current.full:
        out.append(current)
    return out
