"""Daily token budgets shared by the routers of a site (a `Budget`).

The store keeps, per budget key and UTC day, one hash: each router's settled tokens under
its router ID and what it holds for requests still running under "ID~". A router writes
its own fields every round it changed them (a total, not a delta: a write lost in a
failover is healed by the next one) and reads the hashes of the keys it served lately.
What a key has left is its limit minus this router's total and the others' as last read.

The only wait on the store in the whole request path is here: the first request of the day
for a key with a limit reads that key's hash, for at most `FIRST_READ_TIMEOUT`, and
concurrent requests for the key share that read.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from hivenet_router.clock import Clock
from hivenet_router.state.local import DailyCounter, compact
from hivenet_router.state.ports import Verdict

log = logging.getLogger("hivenet_router.sync")

FIRST_READ_TIMEOUT = 0.2
ACTIVE_FOR = 300.0  # seconds a key is re-read every round after it was last charged
IN_FLIGHT = "~"  # suffix of the field holding a router's in-flight tokens


@dataclass(slots=True)
class _Key:
    day: str
    limit: float = 0.0
    others: int = 0  # the other routers' settled and in-flight tokens, as last read
    touched: float = 0.0  # monotonic time of the last charge
    base: tuple[float, int] | None = None  # (left for the site, own total) at the last sync


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
        entry.limit = limit
        own = self.used(key)
        left = limit - entry.others - own
        if not self._synced() and entry.base is not None:
            site_left, own_then = entry.base
            left = min(left, site_left / max(1, self._share()) - (own - own_then))
        if amount > left:
            return Verdict(False, max(0, int(limit - entry.others - own)))
        slot = (key, day)
        self._used[slot] = own + int(amount)
        self._inflight[slot] = self._inflight.get(slot, 0) + int(amount)
        entry.touched = self._clock.monotonic()
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
            entry = self._keys[key] = _Key(day)
        return entry

    async def _load(self, key: str, day: str) -> None:
        try:
            async with asyncio.timeout(FIRST_READ_TIMEOUT):
                fields = await self._read(day, key)
        except Exception as error:  # the store is down or slow: go on alone
            self.first_reads_failed += 1
            log.debug("first daily read for a key failed: %s", error)
            self._keys[key] = _Key(day)
            return
        self._keys[key] = _Key(day)
        mine = fields.get(self._me)
        if mine is not None and mine.isdigit():
            # This router restarted today: what it settled before counts again.
            slot = (key, day)
            self._used[slot] = max(self._used.get(slot, 0), int(mine))
        self.absorb(key, fields, self.live())

    def absorb(self, key: str, fields: dict[bytes, bytes], live: dict[bytes, bytes]) -> None:
        """The key's hash as read this round. In-flight fields ("ID~incarnation") count only
        for a live router's current process (`live`: router ID to incarnation)."""
        entry = self._keys.get(key)
        if entry is None:
            return
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
        entry.others = others

    # -- the sync round ----------------------------------------------------------------------

    def writes(self) -> list[tuple[str, str, int, int]]:
        """(day, key, settled, in flight) for every key changed since the last call."""
        day, out = self.day(), []
        for key in self._dirty:
            slot = (key, day)
            if slot in self._used:
                held = self._inflight.get(slot, 0)
                out.append((day, key, self._used[slot] - held, held))
        self._dirty.clear()
        return out

    def rewrite(self, writes: list[tuple[str, str, int, int]]) -> None:
        """A round failed: write these again next time."""
        self._dirty.update(key for _, key, _, _ in writes)

    def active(self) -> list[str]:
        """Keys charged lately, whose hashes each round reads again."""
        day, now = self.day(), self._clock.monotonic()
        return [
            key
            for key, entry in self._keys.items()
            if entry.day == day and now - entry.touched < ACTIVE_FOR
        ]

    def synced_now(self) -> None:
        """A round succeeded: remember what was left, for a later outage's share."""
        day = self.day()
        for key, entry in self._keys.items():
            if entry.day == day and entry.limit:
                own = self.used(key)
                entry.base = (max(0.0, entry.limit - entry.others - own), own)

    def store_lost(self) -> None:
        """The store lost its data: every total of today is written again."""
        day = self.day()
        self._dirty.update(key for key, d in self._used if d == day)

    def sweep(self) -> None:
        super().sweep()
        day = self.day()
        compact(self._keys, lambda entry: entry.day == day)
        self._inflight = {slot: held for slot, held in self._inflight.items() if slot[1] == day}
