"""Bounded FIFO queues: the global pending-request queue and the per-model capacity queues."""

from __future__ import annotations

import asyncio
from collections import deque


class CapacityQueue:
    """Requests waiting for an agent slot on one model, first come first served.

    `wake_one` runs when a slot frees, `wake_all` when an agent joins. A woken request that
    still finds no slot goes back to the front, so waiting never loses its place.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._waiters: deque[asyncio.Future[None]] = deque()

    def __len__(self) -> int:
        return len(self._waiters)

    @property
    def full(self) -> bool:
        return len(self._waiters) >= self.limit

    async def wait(self, front: bool = False) -> None:
        """Wait to be woken. Cancellation (the deadline) leaves no entry behind."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if front:
            self._waiters.appendleft(waiter)
        else:
            self._waiters.append(waiter)
        try:
            await waiter
        except BaseException:
            if waiter in self._waiters:
                self._waiters.remove(waiter)
            elif waiter.done() and not waiter.cancelled():
                # Woken and cancelled at once: pass the wake-up on so no slot goes unclaimed.
                self.wake_one()
            raise

    def wake_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def wake_all(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)


class PendingQueue:
    """The global queue in front of the forwarding slots.

    At most `size` requests may wait for one of the `max_concurrent` forwarding slots; when
    that many already wait, a newcomer waits up to `enqueue_timeout` for room, then is
    refused with queue_full.
    """

    def __init__(self, size: int, max_concurrent: int) -> None:
        self.size = size
        self.waiting = 0
        self.forwarding = 0
        self._room = asyncio.Semaphore(size)
        self._slots = asyncio.Semaphore(max_concurrent)

    async def enter(self, enqueue_timeout: float) -> bool:
        """Take a place in the queue; False when none freed up within the timeout."""
        if not self._room.locked():
            await self._room.acquire()  # free room: no timer needed on the hot path
        else:
            try:
                async with asyncio.timeout(enqueue_timeout):
                    await self._room.acquire()
            except TimeoutError:
                return False
        self.waiting += 1
        return True

    async def take_slot(self) -> None:
        """Move from the queue to a forwarding slot. Always leaves the queue, even if cancelled."""
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
            self._room.release()
        self.forwarding += 1

    def release_slot(self) -> None:
        self.forwarding -= 1
        self._slots.release()
