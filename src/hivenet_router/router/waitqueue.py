"""Bounded queues: the global pending-request queue and the per-model capacity queues."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
from collections import deque

from hivenet_router.slots import Slots


class Place:
    """One request's place in a model's queue; keeps its turn across re-waits.

    Made by `CapacityQueue.place`. `tag` is the place's virtual finish time: None until the
    place reaches the front of its tenant's line, then kept for good once the place is woken,
    so a re-wait after a wake-up that found no slot goes ahead of everyone who came later.
    """

    __slots__ = ("_owner", "_seq", "_waiting", "cost", "tag", "tenant", "weight")

    def __init__(self, owner: CapacityQueue, tenant: str, weight: float, cost: float) -> None:
        self.tenant = tenant
        self.weight = weight
        self.cost = cost
        self.tag: float | None = None
        self._owner = owner
        self._seq = 0
        self._waiting = False

    def __repr__(self) -> str:
        return (
            f"Place(tenant={self.tenant!r}, weight={self.weight}, cost={self.cost}, tag={self.tag})"
        )


class _Waiter:
    """One call of `CapacityQueue.wait`: a place and the future its caller sleeps on."""

    __slots__ = ("future", "in_heap", "in_line", "place", "queued")

    def __init__(self, place: Place, future: asyncio.Future[None], in_line: bool) -> None:
        self.place = place
        self.future = future
        self.in_line = in_line
        self.queued = True  # counts in len(queue) until woken or cancelled
        self.in_heap = False


class _Line:
    """One tenant's first-time waiters in arrival order. Its first entry is always queued
    and is the only one of them in the heap; cancelled ones behind it are skipped later."""

    __slots__ = ("entries", "live")

    def __init__(self) -> None:
        self.entries: deque[_Waiter] = deque()
        self.live = 0


class CapacityQueue:
    """Requests waiting for an agent slot on one model, shared fairly between tenants.

    Self-clocked weighted fair queueing on token cost: the front request of each tenant's
    line gets the finish tag V + cost / weight, where V is the tag of the latest place woken,
    and `wake_one` wakes the smallest tag. A tenant backlogged with weight w therefore gets
    a share of service proportional to w, and a tenant that was idle starts at V: it gets no
    credit for the idle time.

    Tags are given when a place reaches the front of its tenant's line rather than when it
    arrives, so a request cancelled before its turn (a deadline) costs its tenant nothing:
    had every arrival been tagged, the tenant's later requests would queue behind service
    it never received. Nothing per tenant is kept once the tenant has nobody waiting.

    `wake_one` runs when a slot frees, `wake_all` when an agent joins. A woken request that
    still finds no slot waits again with the same place and keeps its tag, which is never
    above V, so it goes ahead of every request that has not been woken yet; one that takes
    a slot is `served`, which brings V up to its tag if a wake-up for everyone left V
    behind.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._virtual = 0.0
        self._live = 0
        # (tag, arrival, push, waiter): the push number keeps tuples from comparing waiters.
        self._heap: list[tuple[float, int, int, _Waiter]] = []
        self._stale = 0  # heap entries whose waiter is no longer queued
        self._lines: dict[str, _Line] = {}
        self._counts: dict[str, int] = {}
        # The tag of each waiting tenant's latest woken place: its next request starts after
        # it even when the virtual time has not moved (wake_all does not move it).
        self._last: dict[str, float] = {}
        self._arrivals = itertools.count()
        self._pushes = itertools.count()
        self._freed = 0  # slots freed so far
        self._passed = -1  # the freed count at the last pass_on

    def slot_freed(self) -> None:
        """A slot on this model freed: wake the next waiter."""
        self._freed += 1
        self._wake_next()

    def pass_on(self) -> None:
        """A request found a free slot it cannot use (an agent it failed on, or one its
        step, gates or breakers exclude): every waiter looks again, in turn, once per
        freed slot. Handing the wake-up to the next in line only could bring it back to
        this request (a re-wait keeps its early tag) while one further back that could use
        the slot slept; doing it at every look would have waiters that cannot use it wake
        each other for ever."""
        if self._passed != self._freed:
            self._passed = self._freed
            self.wake_all()

    def __len__(self) -> int:
        return self._live

    @property
    def full(self) -> bool:
        return self._live >= self.limit

    def place(self, tenant: str = "", weight: float = 1.0, cost: float = 1.0) -> Place:
        """A place for one request: `cost` is its estimated tokens (at least 1 counts)."""
        if not (weight > 0 and math.isfinite(weight)):
            raise ValueError(f"weight must be a finite number above 0, not {weight}")
        if not math.isfinite(cost):
            raise ValueError(f"cost must be a finite number, not {cost}")
        cost = max(float(cost), 1.0)
        if not math.isfinite(cost / weight):
            raise ValueError(f"cost {cost} over weight {weight} is out of range")
        return Place(self, tenant, weight, cost)

    async def wait(self, place: Place) -> None:
        """Wait to be woken. Cancellation (the deadline) leaves no entry behind."""
        if place._owner is not self:
            raise ValueError("the place belongs to another queue")
        if place._waiting:
            raise RuntimeError("the place is already waiting")
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiter = self._enter(place, future)
        place._waiting = True
        try:
            await future
        except BaseException:
            if waiter.queued:
                self._leave(waiter)
            elif not future.cancelled():
                # Woken and cancelled at once: pass the wake-up on so no slot goes unclaimed.
                self.wake_one()
            if future.cancelled() and waiter.in_line:
                # Never woken: a later wait is a new arrival, not a re-wait.
                place.tag = None
            raise
        finally:
            place._waiting = False

    def wake_one(self) -> None:
        """Wake the waiter with the smallest tag (ties: the earliest arrival)."""
        self._wake_next()

    def wake_all(self) -> None:
        # One at a time, so the woken run (and re-wait) in their fair order. A wake-up for
        # everyone (an agent joined, or a heartbeat may have changed what gates allow) is
        # not service: at most one of them gets a slot, so the virtual time stays where it
        # is. Moving it to the largest tag woken would put every later arrival, of any
        # tenant, behind the whole backlog.
        while self._live and self._wake_next(advance=False):
            pass

    def served(self, place: Place) -> None:
        """The place's request took a slot. The virtual time reaches its tag: a wake-up
        for everyone does not move it, but the service it led to must, or a tenant arriving
        afterwards would start below the tags just served and get their share again.

        Never past a tag still waiting, though: after a wake-up for everyone a place far
        down the order (a huge cost, a tiny weight) may take the slot that one ahead of it
        could not use, and moving the virtual time to its tag would put every newcomer
        behind the whole backlog. (An entry in the heap whose waiter has left only makes
        the bound lower.)"""
        tag = place.tag
        if tag is None or tag <= self._virtual:
            return
        if self._heap:
            tag = min(tag, self._heap[0][0])
        if tag > self._virtual:
            self._virtual = tag
            if self._last:
                self._forget_idle()

    def waiting_by_tenant(self) -> dict[str, int]:
        """Requests waiting now, per tenant with any."""
        return dict(self._counts)

    def _wake_next(self, advance: bool = True) -> bool:
        while self._heap:
            tag, _, _, waiter = heapq.heappop(self._heap)
            waiter.in_heap = False
            if not waiter.queued:
                self._stale -= 1
                continue
            if waiter.future.done():
                # Its task was cancelled and has not run yet: it cannot take the wake-up.
                self._drop(waiter)
                continue
            if advance and tag > self._virtual:
                self._virtual = tag
                if self._last:
                    self._forget_idle()
            tenant = waiter.place.tenant
            self._last[tenant] = max(self._last.get(tenant, tag), tag)
            self._drop(waiter)
            waiter.future.set_result(None)
            return True
        return False

    def _forget_idle(self) -> None:
        """Drop the tags of tenants with nobody waiting that V has now passed. (A tenant
        woken by a wake-up for everyone may go idle with a tag above V; it keeps it until V
        passes, so that it cannot come back below its own earlier requests.)"""
        virtual, counts = self._virtual, self._counts
        for tenant in [t for t, tag in self._last.items() if tag <= virtual and t not in counts]:
            del self._last[tenant]

    def _enter(self, place: Place, future: asyncio.Future[None]) -> _Waiter:
        tenant = place.tenant
        self._live += 1
        self._counts[tenant] = self._counts.get(tenant, 0) + 1
        if place.tag is not None:
            # A re-wait: its tenant's later arrivals still start after its tag.
            self._last[tenant] = max(self._last.get(tenant, place.tag), place.tag)
            waiter = _Waiter(place, future, in_line=False)
            self._push(waiter, place.tag)
            return waiter
        waiter = _Waiter(place, future, in_line=True)
        place._seq = next(self._arrivals)
        line = self._lines.get(tenant)
        if line is None:
            line = self._lines[tenant] = _Line()
            line.entries.append(waiter)
            line.live = 1
            self._start(waiter)
        else:
            line.entries.append(waiter)
            line.live += 1
        return waiter

    def _start(self, waiter: _Waiter) -> None:
        """Tag a place that has reached the front of its tenant's line."""
        place = waiter.place
        start = max(self._virtual, self._last.get(place.tenant, self._virtual))
        place.tag = start + place.cost / place.weight
        self._push(waiter, place.tag)

    def _push(self, waiter: _Waiter, tag: float) -> None:
        heapq.heappush(self._heap, (tag, waiter.place._seq, next(self._pushes), waiter))
        waiter.in_heap = True

    def _leave(self, waiter: _Waiter) -> None:
        """Take out a waiter cancelled before it was woken."""
        if waiter.in_heap:
            self._stale += 1
        self._drop(waiter)
        if self._stale > 32 and self._stale > self._live:
            # Lazy deletion would otherwise let a stream of cancellations grow the heap.
            self._heap = [entry for entry in self._heap if entry[3].queued]
            heapq.heapify(self._heap)
            self._stale = 0

    def _drop(self, waiter: _Waiter) -> None:
        """Stop counting a waiter; if it led its tenant's line, the next one takes the lead."""
        waiter.queued = False
        self._live -= 1
        tenant = waiter.place.tenant
        left = self._counts[tenant] - 1
        if left:
            self._counts[tenant] = left
        else:
            del self._counts[tenant]
            if self._last.get(tenant, 0.0) <= self._virtual:
                # Idle and owed nothing: it will start at V like any newcomer.
                self._last.pop(tenant, None)
        if not self._live:
            # Only stale entries can remain: drop them rather than wait for wake-ups.
            self._heap.clear()
            self._stale = 0
        if not waiter.in_line:
            return
        line = self._lines[tenant]
        line.live -= 1
        if not line.live:
            del self._lines[tenant]
            return
        entries = line.entries
        if entries[0] is waiter:
            entries.popleft()
            while not entries[0].queued:
                entries.popleft()
            self._start(entries[0])
        elif len(entries) > 2 * line.live + 16:
            line.entries = deque(entry for entry in entries if entry.queued)


class PendingQueue:
    """The global queue in front of the forwarding slots.

    At most `size` requests may wait for one of the `limit` forwarding slots; when that many
    already wait, a newcomer waits up to `enqueue_timeout` for room, then is refused with
    queue_full. `resize` changes both while requests are in flight: nobody who holds a slot
    or a place loses it; below the number in use, newcomers wait until enough have left.
    """

    def __init__(self, size: int, limit: int) -> None:
        self.size = size
        self.limit = limit
        self.waiting = 0
        self.forwarding = 0
        self._room = Slots(size)
        self._slots = Slots(limit)

    def resize(self, size: int, limit: int) -> None:
        if size < 1 or limit < 1:
            raise ValueError(f"queue size {size} and limit {limit} must be at least 1")
        self._room.add(size - self.size)
        self._slots.add(limit - self.limit)
        self.size, self.limit = size, limit

    async def enter(self, enqueue_timeout: float) -> bool:
        """Take a place in the queue; False when none freed up within the timeout."""
        if not self._room.take():  # free room: no await and no timer on the hot path
            try:
                async with asyncio.timeout(enqueue_timeout):
                    await self._room.wait()
            except TimeoutError:
                return False
        self.waiting += 1
        return True

    async def take_slot(self) -> None:
        """Move from the queue to a forwarding slot. Always leaves the queue, even if cancelled."""
        try:
            if not self._slots.take():
                await self._slots.wait()
        finally:
            self.waiting -= 1
            self._room.release()
        self.forwarding += 1

    def release_slot(self) -> None:
        self.forwarding -= 1
        self._slots.release()
