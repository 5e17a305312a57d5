"""A counting semaphore for the request path: a free slot is taken without an await.

asyncio.Semaphore costs several Python calls per acquire and release (`locked()` scans the
waiters), and the router and the agent take two or three per request. `Slots` keeps the
same promises with plain attribute work when a slot is free:

- waiters are served first come, first served, and a released slot goes straight to the
  first waiter still waiting, so a newcomer cannot overtake the line;
- a waiter cancelled after it was handed a slot passes the slot on, so none is lost.

Use `if not slots.take(): await slots.wait()` on the hot path, `release()` once for each.
`add` changes the number of slots while they are in use: lowered below the number taken, the
count of free slots goes negative, nobody in use loses a slot, and releases pay the
difference back before the next waiter gets one.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque


class Slots:
    __slots__ = ("_free", "_waiters")

    def __init__(self, count: int) -> None:
        if count < 0:
            raise ValueError("slot count must not be negative")
        self._free = count
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def free(self) -> int:
        """Slots free now; negative while more are taken than there are slots."""
        return self._free

    def locked(self) -> bool:
        """No slot is free now (a caller would wait)."""
        return self._free <= 0

    def take(self) -> bool:
        """Take a free slot if there is one. While anyone waits, none is free."""
        if self._free > 0:
            self._free -= 1
            return True
        return False

    async def wait(self) -> None:
        """Wait in line for a slot (after `take()` found none)."""
        if self.take():
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release()  # handed a slot, then cancelled: pass it on
            else:
                # Leave the line now, not at the next release; a release that ran between
                # the cancel and this line has already dropped it.
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
            raise

    async def acquire(self) -> None:
        if not self.take():
            await self.wait()

    def release(self) -> None:
        if self._free >= 0:  # below 0, a slot given back pays off a lowered count first
            waiters = self._waiters
            while waiters:
                waiter = waiters.popleft()
                if not waiter.done():
                    waiter.set_result(None)
                    return
        self._free += 1

    def add(self, count: int) -> None:
        """Add `count` slots, or take away -`count`. Taking away never takes a slot from
        whoever holds one: new takers wait until enough have been given back."""
        if count < 0:
            self._free += count
            return
        for _ in range(count):
            self.release()  # pays off a deficit first, then wakes waiters in order
