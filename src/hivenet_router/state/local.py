"""The in-process state ports: token buckets, daily totals and occupancy pools in memory.

Every check-and-charge is one synchronous step on the event loop, which is what makes it
atomic. Idle entries are forgotten by `sweep`, so memory follows the keys in use.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from hivenet_router.clock import Clock
from hivenet_router.state.ports import Verdict

V = TypeVar("V")
IDLE_POOL_SECONDS = 15 * 60


def compact(table: dict[Any, V], wanted: Callable[[V], bool]) -> None:
    """Drop unwanted entries in place and give the table's memory back: a dict keeps the
    size it once had until it is cleared (the object stays the same for its holders)."""
    kept = {key: value for key, value in table.items() if wanted(value)}
    table.clear()
    table.update(kept)


class _Bucket:
    __slots__ = ("capacity", "level", "per_second", "stamp")

    def __init__(self, capacity: float, per_second: float, now: float) -> None:
        self.capacity = capacity
        self.per_second = per_second
        self.level = capacity
        self.stamp = now

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.per_second)
        self.stamp = now

    def full(self, now: float) -> bool:
        return self.level + (now - self.stamp) * self.per_second >= self.capacity


class RateCounter:
    """Per-minute limits as continuously refilling buckets: `limit` per minute, holding at
    most a minute's worth (or `burst_seconds` of it, at least one). Exact usage trued up
    after a charge (`adjust`) may take a bucket into debt, at most one bucket deep: `left`
    is then negative, and no charge passes until the refill has paid the debt back."""

    def __init__(self, clock: Clock, burst_seconds: int = 0) -> None:
        self._clock = clock
        self._burst = burst_seconds
        self._buckets: dict[str, _Bucket] = {}

    def __len__(self) -> int:
        return len(self._buckets)

    def _bucket(self, key: str, limit: float, now: float) -> _Bucket:
        capacity = (
            float(limit) if not self._burst else max(1.0, math.floor(limit * self._burst / 60))
        )
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = _Bucket(capacity, limit / 60.0, now)
        else:
            bucket.refill(now)
            if bucket.capacity != capacity:
                bucket.capacity, bucket.per_second = capacity, limit / 60.0
                bucket.level = min(bucket.level, capacity)
        return bucket

    async def charge(self, key: str, amount: float, limit: float) -> Verdict:
        return self.charge_now(key, amount, limit)

    def charge_now(self, key: str, amount: float, limit: float) -> Verdict:
        if limit <= 0:
            return Verdict(True)
        bucket = self._bucket(key, limit, self._clock.monotonic())
        if bucket.level < amount:
            return Verdict(False, int(bucket.level))
        bucket.level -= amount
        return Verdict(True, int(bucket.level))

    async def adjust(self, key: str, delta: float, limit: float) -> None:
        if limit <= 0:
            return
        bucket = self._bucket(key, limit, self._clock.monotonic())
        # One answer can put the bucket into debt, never deeper than one bucket.
        bucket.level = min(bucket.capacity, max(-bucket.capacity, bucket.level - delta))

    async def left(self, key: str, limit: float) -> float:
        if limit <= 0:
            return math.inf
        return self._bucket(key, limit, self._clock.monotonic()).level

    def sweep(self) -> None:
        """Forget buckets that have refilled: a new one would start in the same state."""
        now = self._clock.monotonic()
        compact(self._buckets, lambda bucket: not bucket.full(now))


class DailyCounter:
    """Totals per key and UTC day. A day's totals are forgotten once it is over."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._used: dict[tuple[str, str], int] = {}
        self._day_cache = (-1, "")

    def __len__(self) -> int:
        return len(self._used)

    def day(self) -> str:
        number = int(self._clock.wall() // 86_400)
        if number != self._day_cache[0]:
            self._day_cache = (number, time.strftime("%Y-%m-%d", time.gmtime(number * 86_400)))
        return self._day_cache[1]

    async def charge(self, key: str, amount: float, limit: float) -> Verdict:
        if limit <= 0:
            return Verdict(True)
        slot = (key, self.day())
        used = self._used.get(slot, 0)
        if used + amount > limit:
            return Verdict(False, max(0, int(limit - used)))
        self._used[slot] = used + int(amount)
        return Verdict(True, int(limit - used - amount))

    async def settle(self, key: str, charged: float, spent: float) -> None:
        await self.adjust(key, spent - charged, 0)

    async def adjust(self, key: str, delta: float, limit: float) -> None:
        slot = (key, self.day())
        if slot in self._used:
            self._used[slot] = max(0, self._used[slot] + int(delta))

    async def left(self, key: str, limit: float) -> float:
        if limit <= 0:
            return math.inf
        return max(0.0, limit - self._used.get((key, self.day()), 0))

    def used(self, key: str) -> int:
        return self._used.get((key, self.day()), 0)

    def today(self) -> tuple[str, dict[str, int]]:
        """Today's UTC date and totals by key, for persistence and the admin API."""
        day = self.day()
        return day, {key: used for (key, d), used in self._used.items() if d == day}

    def restore(self, day: str, totals: dict[str, int]) -> None:
        """Put back totals saved earlier; only today's count."""
        if day == self.day():
            for key, used in totals.items():
                self._used[(key, day)] = max(self._used.get((key, day), 0), used)

    def sweep(self) -> None:
        day = self.day()
        compact_keys = {k: v for k, v in self._used.items() if k[1] == day}
        self._used.clear()
        self._used.update(compact_keys)


class _Occupancy:
    """One key's reservations: tokens, a count, and a FIFO line of waiters."""

    __slots__ = ("inflight", "key", "last_used", "tokens", "waiters")

    def __init__(self, key: str, now: float) -> None:
        self.key = key
        self.tokens = 0
        self.inflight = 0
        self.last_used = now
        self.waiters: deque[asyncio.Future[None]] = deque()

    def wake_next(self) -> None:
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return


class LocalLease:
    """A reservation in a LocalPool; released exactly once, on every path."""

    __slots__ = ("_entry", "_pool", "amount")

    def __init__(self, pool: LocalPool, entry: _Occupancy, amount: int) -> None:
        self._pool = pool
        self._entry: _Occupancy | None = entry
        self.amount = amount

    def grow(self, delta: int) -> None:
        if self._entry is not None and delta:
            self._entry.tokens += delta
            self.amount += delta

    def release(self) -> None:
        entry, self._entry = self._entry, None
        if entry is None:
            return
        entry.tokens -= self.amount
        entry.inflight -= 1
        entry.last_used = self._pool.clock.monotonic()
        entry.wake_next()

    async def __aenter__(self) -> LocalLease:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.release()


class LocalPool:
    """Token-weighted work in flight per key. With `alone_fits`, a reservation always fits
    an empty pool (nothing else could ever make room for an oversized request); without
    it the budget is a hard cap (a key's fair share)."""

    def __init__(self, clock: Clock, *, alone_fits: bool) -> None:
        self.clock = clock
        self._alone_fits = alone_fits
        self._entries: dict[str, _Occupancy] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def _fits(self, entry: _Occupancy, amount: int, budget: int, most: int) -> bool:
        if most and entry.inflight >= most:
            return False
        if not budget or (self._alone_fits and entry.inflight == 0):
            return True
        return entry.tokens + amount <= budget

    async def reserve(
        self, key: str, amount: int, budget: int, wait: float, most: int = 0
    ) -> LocalLease | None:
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Occupancy(key, self.clock.monotonic())
        fits = not entry.waiters and self._fits(entry, amount, budget, most)
        if not fits:
            if not await self._wait(entry, amount, budget, most, wait):
                return None
            # Woken by a release that may have freed room for more than this one: the next
            # in line looks too (each woken one that fits passes it on).
            entry.wake_next()
        entry.tokens += amount
        entry.inflight += 1
        entry.last_used = self.clock.monotonic()
        return LocalLease(self, entry, amount)

    async def _wait(
        self, entry: _Occupancy, amount: int, budget: int, most: int, wait: float
    ) -> bool:
        """Wait in line until this reservation fits (True) or `wait` passes (False). The
        line is first come, first served: one woken that still does not fit keeps its
        place at the head, and nobody behind it goes first."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        head = False
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            waiter: asyncio.Future[None] = loop.create_future()
            if head:
                entry.waiters.appendleft(waiter)
            else:
                entry.waiters.append(waiter)
            woken = False
            try:
                async with asyncio.timeout(remaining):
                    await waiter
                woken = True
            except TimeoutError:
                return False
            finally:
                if waiter in entry.waiters:
                    entry.waiters.remove(waiter)
                if not woken:
                    # Leaving the line (timed out or cancelled, woken in the same turn or
                    # not): the next one looks, or room could sit unused behind us.
                    entry.wake_next()
            if self._fits(entry, amount, budget, most):
                return True
            head = True

    def wake_all(self, key: str) -> None:
        """Let every waiter of `key` check again (room appeared other than by a release)."""
        entry = self._entries.get(key)
        if entry is not None:
            for waiter in entry.waiters:
                if not waiter.done():
                    waiter.set_result(None)

    def idle_for(self, key: str) -> float:
        """Seconds since `key` last held anything (0 while it holds something)."""
        entry = self._entries.get(key)
        if entry is None:
            return math.inf
        if entry.inflight or entry.waiters:
            return 0.0
        return self.clock.monotonic() - entry.last_used

    def levels(self) -> Iterator[tuple[str, int, int]]:
        """(key, tokens, reservations) for every key held, for gauges read at scrape time."""
        for key, entry in list(self._entries.items()):
            yield key, entry.tokens, entry.inflight

    def held(self, key: str) -> int:
        entry = self._entries.get(key)
        return entry.tokens if entry is not None else 0

    def sweep(self, idle_after: float = IDLE_POOL_SECONDS) -> None:
        """Forget keys that have held nothing for `idle_after` seconds."""
        now = self.clock.monotonic()
        compact(
            self._entries,
            lambda e: bool(e.inflight or e.waiters or now - e.last_used < idle_after),
        )
