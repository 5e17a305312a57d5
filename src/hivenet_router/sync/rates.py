"""Per-minute limits shared by the routers of a site (a `Counter`).

Each key has two refilling buckets. The site bucket holds what the whole site may still
spend: this router charges it at once and subtracts what the other routers published each
round. The own bucket is this router's part of it for the current round: after every round
it is reset to the site bucket's level divided by the live routers, and it refills at the
rate divided by them. A charge needs room in both, so in one round the routers together
spend at most what the site bucket held, whatever order their requests come in. While the
store is unreachable no round resets the own bucket: the router runs on its share alone.

A round costs what changed in it, not the number of keys followed: the keys charged since
the last round are kept aside for `take_pending`, and the reset after a round is applied to
each bucket when it is next used (or when the next round subtracts from it), which gives the
same levels as resetting every bucket at the round.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from hivenet_router.clock import Clock
from hivenet_router.state.local import compact
from hivenet_router.state.ports import Verdict

FOREIGN_MEMORY = 60.0  # seconds a foreign spend on an unknown key is remembered


class _Buckets:
    __slots__ = ("capacity", "generation", "mine", "pending", "per_second", "site", "stamp")

    def __init__(
        self,
        capacity: float,
        per_second: float,
        level: float,
        share: int,
        now: float,
        generation: int,
    ):
        self.generation = generation  # the last round whose reset this bucket has had
        self.capacity = capacity
        self.per_second = per_second
        self.site = level
        self.mine = level / share
        self.stamp = now
        self.pending = 0.0  # own spend not yet published

    def refill(self, now: float, share: int) -> None:
        elapsed = max(0.0, now - self.stamp)
        self.stamp = now
        self.site = min(self.capacity, self.site + elapsed * self.per_second)
        self.mine = min(self.capacity / share, self.mine + elapsed * self.per_second / share)

    def spend(self, amount: float, share: int) -> None:
        # Exact usage trued up after a charge may leave debt, at most one bucket deep.
        self.site = min(self.capacity, max(-self.capacity, self.site - amount))
        self.mine = min(self.capacity / share, max(-self.capacity / share, self.mine - amount))
        self.pending += amount


@dataclass(slots=True)
class _Foreign:
    amount: float
    stamp: float


class SiteRates:
    """`limit` per minute per key, for the whole site. `share()` is how many routers the
    budget is divided between now (live routers; while cut off, the last known count and
    at least --sync-min-routers). Without `check_share` only the site bucket refuses."""

    def __init__(
        self,
        clock: Clock,
        share: Callable[[], int],
        burst_seconds: int = 0,
        *,
        check_share: bool = True,
    ) -> None:
        self._clock = clock
        self._share = share
        self._burst = burst_seconds
        self._check_own = check_share
        self._buckets: dict[str, _Buckets] = {}
        self._foreign: dict[str, _Foreign] = {}
        self._spent: set[str] = set()  # keys with own spend not yet published
        # The last good round: its number, its time and its share; buckets are reset to
        # their share of the site's level lazily (`_catch_up`).
        self._generation = 0
        self._generation_at = 0.0
        self._generation_share = 1

    def __len__(self) -> int:
        return len(self._buckets)

    def _capacity(self, limit: float) -> float:
        if not self._burst:
            return float(limit)
        return max(1.0, math.floor(limit * self._burst / 60))

    def _get(self, key: str, limit: float) -> _Buckets:
        now, share = self._clock.monotonic(), max(1, self._share())
        capacity = self._capacity(limit)
        buckets = self._buckets.get(key)
        if buckets is None:
            level = capacity
            foreign = self._foreign.pop(key, None)
            if foreign is not None:
                level -= max(0.0, foreign.amount - (now - foreign.stamp) * limit / 60.0)
            buckets = self._buckets[key] = _Buckets(
                capacity, limit / 60.0, max(-capacity, level), share, now, self._generation
            )
            return buckets
        if buckets.generation != self._generation:
            self._catch_up(buckets)
        buckets.refill(now, share)
        if buckets.capacity != capacity:
            buckets.capacity, buckets.per_second = capacity, limit / 60.0
            buckets.site = min(buckets.site, capacity)
            buckets.mine = min(buckets.mine, capacity / share)
        return buckets

    async def charge(self, key: str, amount: float, limit: float) -> Verdict:
        if limit <= 0:
            return Verdict(True)
        buckets = self._get(key, limit)
        room = min(buckets.site, buckets.mine) if self._check_own else buckets.site
        if room < amount:
            return Verdict(False, int(room))
        buckets.spend(amount, max(1, self._share()))
        self._spent.add(key)
        return Verdict(True, int(min(buckets.site, buckets.mine)))

    async def adjust(self, key: str, delta: float, limit: float) -> None:
        if limit <= 0:
            return
        self._get(key, limit).spend(delta, max(1, self._share()))
        self._spent.add(key)

    async def left(self, key: str, limit: float) -> float:
        if limit <= 0:
            return math.inf
        return self._get(key, limit).site

    # -- the sync round ---------------------------------------------------------------------

    def take_pending(self) -> dict[str, float]:
        """Own spend since the last call, to publish (cleared here)."""
        out: dict[str, float] = {}
        for key in self._spent:
            buckets = self._buckets.get(key)
            if buckets is not None and buckets.pending:
                out[key] = buckets.pending
                buckets.pending = 0.0
        self._spent = set()
        return out

    def give_back(self, pending: dict[str, float]) -> None:
        """A publish failed: keep its spend for the next round."""
        for key, amount in pending.items():
            buckets = self._buckets.get(key)
            if buckets is not None:
                buckets.pending += amount
                self._spent.add(key)

    def subtract(self, key: str, amount: float) -> None:
        """Another router spent `amount` under `key`."""
        buckets = self._buckets.get(key)
        if buckets is None:
            now = self._clock.monotonic()
            held = self._foreign.get(key)
            if held is None:
                self._foreign[key] = _Foreign(amount, now)
            else:
                held.amount, held.stamp = held.amount + amount, now
            return
        if buckets.generation != self._generation:
            self._catch_up(buckets)
        buckets.site = min(buckets.capacity, max(-buckets.capacity, buckets.site - amount))

    def rebalance(self) -> None:
        """After a good round: each own bucket becomes its share of what the site has left.
        Applied to a bucket when it is next used (`_catch_up`), so that a round costs
        nothing for the keys nobody used."""
        self._generation += 1
        self._generation_at = self._clock.monotonic()
        self._generation_share = max(1, self._share())

    def _catch_up(self, buckets: _Buckets) -> None:
        """The reset of the last good round, as if made at that round: refilled to its
        time, then the own bucket set to the share of the site's level. Every change to
        a bucket (a charge, another router's spend) catches it up first, so what a
        bucket skipped is only refilling, which gives the same level in one step."""
        share = self._generation_share
        buckets.refill(max(self._generation_at, buckets.stamp), share)
        buckets.mine = buckets.site / share
        buckets.generation = self._generation

    def sweep(self) -> None:
        """Forget full buckets with nothing to publish, and old foreign spend."""
        now = self._clock.monotonic()

        def needed(buckets: _Buckets) -> bool:
            refilled = buckets.site + (now - buckets.stamp) * buckets.per_second
            return bool(buckets.pending) or refilled < buckets.capacity

        compact(self._buckets, needed)
        compact(self._foreign, lambda foreign: now - foreign.stamp < FOREIGN_MEMORY)
