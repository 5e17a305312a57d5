"""Deadlines for the running task, for the request path.

`asyncio.timeout` runs five or six Python-level steps per use (the manager, its enter and
exit, `current_task`, the reschedule) and makes a loop timer, which under uvloop is a
libuv handle opened and closed again: about 3 us per request, for a deadline that almost
never fires. The router and the agent each set one per request.

`Deadlines` files each deadline under its 50 ms slot, rounded up, and keeps one loop timer
per slot, whatever the number of requests in it; the slot and its timer go as soon as its
last request is done, so nothing made on the request path outlives the requests (a slot
kept until its deadline, a minute on, pinned memory arenas: the router's RSS grew by a
third over a soak). A deadline so fires up to 50 ms late, and never early. Request
deadlines are seconds or minutes, so that is well inside their meaning. An `Expiry` is
a plain context manager, used as `asyncio.timeout` is (a plain `with`, so entering and
leaving it costs no coroutine):

    with deadlines.start(when):      # loop time; None for no deadline
        ...                          # awaits; TimeoutError when the deadline passes

As with `asyncio.timeout`, a cancel from anywhere else stays a cancel (a deadline that
fires as well is withdrawn and the cancel goes on), and a deadline already past cancels
at the next turn of the loop.

A deadline that moves (a stream's, which runs out when no chunk came for a while) is a
`Watch`: its owner records progress with one store per step, and the deadline is looked at
only when its slot fires, then filed again under the later time it has moved to. A stream
so costs one filing per idle period, not one per chunk.
"""

from __future__ import annotations

import asyncio
import math
from types import TracebackType

GRAIN = 0.05  # seconds: how late a deadline may fire, and how many share a timer


class _Slot:
    """The deadlines of one 50 ms slot, and the loop timer that fires them."""

    __slots__ = ("handle", "key", "members", "owner")

    def __init__(self, owner: Deadlines, key: int, handle: asyncio.TimerHandle) -> None:
        self.owner = owner
        self.key = key
        self.handle = handle
        self.members: set[Expiry] = set()


class Watch:
    """A deadline that moves: `last` (loop time) plus `idle`, never past `end`. Whoever
    makes progress sets `last`; `idle` 0 means only `end` counts."""

    __slots__ = ("end", "idle", "last")

    def __init__(self, last: float, idle: float, end: float) -> None:
        self.last = last
        self.idle = idle
        self.end = end

    def due(self) -> float:
        if not self.idle:
            return self.end
        return min(self.last + self.idle, self.end)

    def ended(self, now: float) -> bool:
        """Was it `end` (not idleness) that ran out by `now`?"""
        return now >= self.end


class Expiry:
    """One task's deadline, from `Deadlines.start` or `Deadlines.watch`."""

    __slots__ = ("_cancelling", "_slot", "_task", "_watch", "_withdrawn", "fired")

    def __init__(self, task: asyncio.Task[object], watch: Watch | None = None) -> None:
        self._task = task
        self._cancelling = task.cancelling()
        self._slot: _Slot | None = None
        self._watch = watch
        self.fired = False
        self._withdrawn = False

    def __enter__(self) -> Expiry:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        if kind is asyncio.CancelledError and self.caused():  # exactly, as asyncio.timeout
            self.cancel()
            raise TimeoutError from error
        self.cancel()

    def _fire(self, owner: Deadlines, now: float) -> None:
        self._slot = None
        watch = self._watch
        if watch is not None:
            due = watch.due()
            if due > now:  # it moved since it was filed: file it again, under its new time
                owner._file(self, due)
                return
        self.fired = True
        self._task.cancel()

    def cancel(self) -> None:
        """The guarded work is over (however it ended): the deadline no longer applies. A
        cancel it made that nobody withdrew (the guarded code turned it into another
        error) is withdrawn here, as `asyncio.timeout` does on exit."""
        slot = self._slot
        if slot is not None:
            self._slot = None
            members = slot.members
            members.discard(self)
            if not members:
                slot.owner._empty(slot)
        if self.fired and not self._withdrawn:
            self._withdrawn = True
            self._task.uncancel()

    def caused(self) -> bool:
        """Called with a CancelledError in hand: True when the deadline cancelled the task
        (and nothing else did). Either way its own cancel is withdrawn."""
        if not self.fired or self._withdrawn:
            return False
        self._withdrawn = True
        return self._task.uncancel() <= self._cancelling


class Deadlines:
    """The deadlines of one component's tasks, on one event loop."""

    __slots__ = ("_grain", "_loop", "_slots")

    def __init__(self, grain: float = GRAIN) -> None:
        if grain <= 0:
            raise ValueError("grain must be positive")
        self._grain = grain
        self._loop: asyncio.AbstractEventLoop | None = None
        self._slots: dict[int, _Slot] = {}

    def start(self, when: float | None) -> Expiry:
        """A deadline at `when` (the loop's time) for the running task; None: never."""
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("a deadline needs a running task")
        expiry = Expiry(task)
        if when is None:
            return expiry
        loop = task.get_loop()
        if loop is not self._loop:  # a new loop (tests run one each): old slots are moot
            self._loop, self._slots = loop, {}
        self._file(expiry, when)
        return expiry

    def watch(self, watch: Watch) -> Expiry:
        """A deadline for the running task that follows `watch` as it moves."""
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("a deadline needs a running task")
        expiry = Expiry(task, watch)
        loop = task.get_loop()
        if loop is not self._loop:
            self._loop, self._slots = loop, {}
        self._file(expiry, watch.due())
        return expiry

    def _file(self, expiry: Expiry, when: float) -> None:
        loop = self._loop
        assert loop is not None
        key = math.ceil(when / self._grain)
        if key * self._grain < when:  # float rounding: never fire before the deadline
            key += 1
        slot = self._slots.get(key)
        if slot is None:
            handle = loop.call_at(key * self._grain, self._expire, key)
            slot = self._slots[key] = _Slot(self, key, handle)
        slot.members.add(expiry)
        expiry._slot = slot

    def after(self, seconds: float | None) -> Expiry:
        """A deadline `seconds` from now (None or 0: none)."""
        if not seconds:
            return self.start(None)
        return self.start(asyncio.get_running_loop().time() + seconds)

    @property
    def pending(self) -> int:
        """Deadlines set and not yet cancelled or fired."""
        return sum(len(slot.members) for slot in self._slots.values())

    @property
    def slots(self) -> int:
        """Slots with a timer: those with a deadline still pending."""
        return len(self._slots)

    def _empty(self, slot: _Slot) -> None:
        """The slot's last deadline was cancelled: drop it and its timer now."""
        if self._slots.get(slot.key) is slot:
            del self._slots[slot.key]
        slot.handle.cancel()

    def _expire(self, key: int) -> None:
        slot = self._slots.pop(key, None)
        if slot is not None:
            now = key * self._grain
            for expiry in list(slot.members):
                expiry._fire(self, now)
