"""Daily token budgets shared by the routers of a site (a `Budget`).

The store keeps, per budget key and UTC day, one hash: each router's settled tokens under
its router ID and what it holds for requests still running under "ID~incarnation". A
router writes its own fields every round it changed them (a total, not a delta: a write
lost in a failover is healed by the next one) and publishes the change with its usage
entry, which the others add to what they know. A key that changed since its hash was last
read (this router's total, or another's usage entry) is read again within `REFRESH_ROUNDS`
rounds (keys spread over the rounds), which heals an entry read twice; a key nobody changed
is not read at all, so a round costs what changed in it, not what is followed. Every
followed key is read again (spread over the same rounds) when a router process leaves the
site, which drops what it held in flight, and at once after a failed round, which heals
entries trimmed or lost meanwhile. What a key has left is its limit minus this router's
total and the others' as known.

The only wait on the store in the whole request path is here: the first request of the day
for a key with a limit reads that key's hash, for at most `FIRST_READ_TIMEOUT`, and
concurrent requests for the key share that read.
"""

from __future__ import annotations

import asyncio
import logging
import math
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from hivenet_router.clock import Clock
from hivenet_router.state.local import DailyCounter, compact
from hivenet_router.state.ports import Verdict

log = logging.getLogger("hivenet_router.sync")

FIRST_READ_TIMEOUT = 0.2
ACTIVE_FOR = 300.0  # seconds a key stays followed after it was last charged
REFRESH_ROUNDS = 30  # each followed key's hash is read again once in this many rounds
IN_FLIGHT = "~"  # suffix of the field holding a router's in-flight tokens


@dataclass(frozen=True, slots=True)
class DailyWrite:
    """One key's own fields to write this round, and the change to publish."""

    day: str
    key: str
    settled: int
    held: int  # in flight
    delta: int  # own total change since the last publish


@dataclass(slots=True)
class _Key:
    day: str
    turn: int  # the round (modulo REFRESH_ROUNDS) in which its hash is read again
    limit: float = 0.0
    others: int = 0  # the other routers' settled and in-flight tokens, as last read
    touched: float = 0.0  # monotonic time of the last charge (refused ones too)
    # At the last good round: what was left for the site (-1: no good round yet) and this
    # router's own total then (two fields, not a tuple: rebased for thousands of keys).
    base_left: float = -1.0
    base_own: int = 0
    unread: bool = False  # the store could not be read for it: what the others spent is unknown


class SiteDaily(DailyCounter):
    """This router's totals (the parent's, in flight included) and the others' as read.

    `read` fetches one key's hash from the store; `share` divides what was left at the last
    good round while the store is unreachable (`synced` false); during the settle window
    after a store loss (`settling`) a key first seen after the loss is refused."""

    def __init__(
        self,
        clock: Clock,
        router_id: str,
        read: Callable[[str, str], Awaitable[dict[bytes, bytes]]],
        synced: Callable[[], bool],
        share: Callable[[], int],
        settling: Callable[[], bool],
        live: Callable[[], dict[bytes, bytes]],
    ) -> None:
        super().__init__(clock)
        self.live = live
        self._me = router_id.encode()
        self._read = read
        self._synced = synced
        self._share = share
        self._settling = settling
        self._keys: dict[str, _Key] = {}
        self._inflight: dict[tuple[str, str], int] = {}
        self._dirty: set[str] = set()
        self._published: dict[tuple[str, str], int] = {}  # own total at the last publish
        self._stale: set[str] = set()  # keys to read again next round
        # Keys that changed since their last read, by the round (modulo REFRESH_ROUNDS)
        # that reads them again.
        self._due: list[set[str]] = [set() for _ in range(REFRESH_ROUNDS)]
        # Keys whose level at the last good round (`_Key.base_left`) must be taken again.
        self._rebase: set[str] = set()
        self._reads: dict[str, asyncio.Future[None]] = {}
        self.first_reads_failed = 0

    # -- the Budget port ---------------------------------------------------------------------

    async def charge(self, key: str, amount: float, limit: float) -> Verdict:
        if limit <= 0:
            return Verdict(True)
        day = self.day()
        entry = self._keys.get(key)
        if entry is None or entry.day != day:
            if self._settling():
                return Verdict(False, 0)  # what the site spent on it is not known yet
            entry = await self._first_read(key, day)
        if entry.limit != limit:
            entry.limit = limit
            self._rebase.add(key)
        entry.touched = self._clock.monotonic()
        own = self.used(key)
        left = limit - entry.others - own
        if entry.unread:
            left = min(left, limit / max(1, self._share()) - own)  # alone: its share only
        elif not self._synced() and entry.base_left >= 0:
            site_left, own_then = entry.base_left, entry.base_own
            left = min(left, site_left / max(1, self._share()) - (own - own_then))
        if amount > left:
            return Verdict(False, max(0, int(limit - entry.others - own)))
        slot = (key, day)
        self._used[slot] = own + int(amount)
        self._inflight[slot] = self._inflight.get(slot, 0) + int(amount)
        self._dirty.add(key)
        return Verdict(True, int(limit - entry.others - own - amount))

    async def settle(self, key: str, charged: float, spent: float) -> None:
        slot = (key, self.day())
        if slot not in self._used:
            return
        held = self._inflight.get(slot, 0)
        self._inflight[slot] = max(0, held - int(charged))
        self._used[slot] = max(0, self._used[slot] + int(spent) - int(charged))
        self._dirty.add(key)

    async def adjust(self, key: str, delta: float, limit: float) -> None:
        await super().adjust(key, delta, limit)
        self._dirty.add(key)

    async def left(self, key: str, limit: float) -> float:
        if limit <= 0:
            return math.inf
        entry = self._keys.get(key)
        others = entry.others if entry is not None and entry.day == self.day() else 0
        return max(0.0, limit - others - self.used(key))

    # -- reading the store -------------------------------------------------------------------

    async def _first_read(self, key: str, day: str) -> _Key:
        pending = self._reads.get(key)
        if pending is None:
            pending = self._reads[key] = asyncio.ensure_future(self._load(key, day))
            pending.add_done_callback(lambda _: self._reads.pop(key, None))
        await asyncio.shield(pending)  # _load does not raise: a failed read means alone
        entry = self._keys.get(key)
        if entry is None or entry.day != day:
            entry = self._keys[key] = _Key(day, _turn(key))
        return entry

    async def _load(self, key: str, day: str) -> None:
        try:
            async with asyncio.timeout(FIRST_READ_TIMEOUT):
                fields = await self._read(day, key)
        except Exception as error:  # the store is down or slow: go on alone
            self.first_reads_failed += 1
            log.debug("first daily read for a key failed: %s", error)
            self._keys[key] = _Key(day, _turn(key), unread=True)
            self._stale.add(key)
            return
        self._keys[key] = _Key(day, _turn(key))
        # Usage entries written before this read but not yet consumed would count twice:
        # the next round reads the hash again, after the stream, and sets it right.
        self._stale.add(key)
        mine = fields.get(self._me)
        if mine is not None and mine.isdigit():
            # This router restarted today: what it settled before counts again (and is in
            # the store already: not a change to publish).
            slot = (key, day)
            self._used[slot] = max(self._used.get(slot, 0), int(mine))
            self._published[slot] = max(self._published.get(slot, 0), int(mine))
        self.absorb(key, fields, self.live())

    def absorb(self, key: str, fields: dict[bytes, bytes], live: dict[bytes, bytes]) -> None:
        """The key's hash as read this round. In-flight fields ("ID~incarnation") count only
        for a live router's current process (`live`: router ID to incarnation)."""
        entry = self._keys.get(key)
        if entry is None:
            return
        mine = fields.get(self._me)
        slot = (key, entry.day)
        if entry.unread and mine is not None and mine.isdigit():
            # The first read of the key that worked, after one that failed. This router's
            # field is what a process before it (same --router-id) settled today: this
            # process has written nothing there yet (writes() waits for this read), so it
            # counts on top of what this one spent meanwhile, and is in the store already
            # (not a change to publish).
            self._used[slot] = self._used.get(slot, 0) + int(mine)
            self._published[slot] = self._published.get(slot, 0) + int(mine)
        if (
            slot in self._used
            and mine != str(self._used[slot] - self._inflight.get(slot, 0)).encode()
        ):
            self._dirty.add(key)  # the store lost or missed this router's write: write it again
        others = 0
        for field, value in fields.items():
            if not value.isdigit():
                continue  # a malformed field adds nothing; the owner rewrites it next round
            owner, mark, incarnation = field.partition(IN_FLIGHT.encode())
            if owner == self._me:
                continue
            if mark and live.get(owner) != incarnation:
                continue  # in flight on a process that is gone
            others += int(value)
        entry.others, entry.unread = others, False
        self._rebase.add(key)

    # -- the sync round ----------------------------------------------------------------------

    def writes(self) -> list[DailyWrite]:
        """Every key changed since the last call: its fields and the change to publish.

        A key not read yet today (its first read failed) waits: what this router's field
        in the store holds (a previous process's total) must be read before it is written
        over. Every write renews the day hash's expiry, so a hash lost and recreated (a
        failover to a replica that missed it) still expires."""
        day, out, unread = self.day(), [], set()
        for key in self._dirty:
            slot = (key, day)
            if slot not in self._used:
                continue
            entry = self._keys.get(key)
            if entry is not None and entry.unread:
                unread.add(key)
                continue
            total, held = self._used[slot], self._inflight.get(slot, 0)
            delta = total - self._published.get(slot, 0)
            self._published[slot] = total
            out.append(DailyWrite(day, key, total - held, held, delta))
            if entry is not None:
                self._changed(key, entry)
        self._dirty = unread
        return out

    def _changed(self, key: str, entry: _Key) -> None:
        """A followed key's total changed (this router's or another's): its hash is read
        again in its turn, and its level is taken at the next good round."""
        self._due[entry.turn].add(key)
        self._rebase.add(key)

    def process_left(self) -> None:
        """A router process left the site (given up, or restarted): what it held in flight
        no longer counts. Every followed key is read again, spread over the next
        REFRESH_ROUNDS rounds."""
        day = self.day()
        for key, entry in self._keys.items():
            if entry.day == day:
                self._due[entry.turn].add(key)

    def reread(self, keys: list[str] | None = None) -> None:
        """Read these keys' hashes (every followed key: None) next round: a round failed,
        or the store was out long enough for usage entries to be trimmed unread."""
        self._stale.update(self._keys if keys is None else keys)

    def rewrite(self, writes: list[DailyWrite]) -> None:
        """A round failed: write and publish these again next time."""
        for write in writes:
            slot = (write.key, write.day)
            self._dirty.add(write.key)
            self._published[slot] = self._published.get(slot, 0) - write.delta

    def add_foreign(self, day: str, key: str, delta: int) -> None:
        """Another router's total for `key` changed by `delta` (its usage entry)."""
        entry = self._keys.get(key)
        if entry is not None and entry.day == day:
            entry.others = max(0, entry.others + delta)
            self._changed(key, entry)

    def to_refresh(self, round_number: int) -> list[str]:
        """Keys whose hash this round reads again: those that changed since their last
        read and whose turn this round is (if charged here in the last ACTIVE_FOR
        seconds), and any whose last read failed or that a failed round left unsure."""
        day, now = self.day(), self._clock.monotonic()
        turn = round_number % REFRESH_ROUNDS
        due, self._due[turn] = self._due[turn], set()
        stale, self._stale = self._stale, set()
        out = []
        for key in stale:
            entry = self._keys.get(key)
            if entry is not None and entry.day == day:
                out.append(key)
        for key in due - stale:
            entry = self._keys.get(key)
            if entry is not None and entry.day == day and now - entry.touched < ACTIVE_FOR:
                out.append(key)
        return out

    def synced_now(self) -> None:
        """A round succeeded: remember what was left, for a later outage's share (for the
        keys whose level changed since the last good round; the others keep theirs)."""
        day = self.day()
        rebase, self._rebase = self._rebase | self._dirty, set()
        for key in rebase:
            entry = self._keys.get(key)
            if entry is not None and entry.day == day and entry.limit:
                own = self._used.get((key, day), 0)
                left = entry.limit - entry.others - own
                entry.base_left, entry.base_own = left if left > 0 else 0.0, own

    def store_lost(self) -> None:
        """The store lost its data: every total of today is written again (what this
        router knows of the others stays: memory is what the store is rebuilt from)."""
        day = self.day()
        self._dirty.update(key for key, d in self._used if d == day)

    def sweep(self) -> None:
        super().sweep()
        day = self.day()
        compact(self._keys, lambda entry: entry.day == day)
        self._inflight = {slot: held for slot, held in self._inflight.items() if slot[1] == day}
        self._published = {slot: n for slot, n in self._published.items() if slot[1] == day}
        self._due = [{key for key in due if key in self._keys} for due in self._due]


def _turn(key: str) -> int:
    """The round (modulo REFRESH_ROUNDS) in which a key's hash is read again."""
    return zlib.crc32(key.encode()) % REFRESH_ROUNDS
