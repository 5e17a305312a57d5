from __future__ import annotations

import asyncio

from hivenet_router.clock import ManualClock, run_in_virtual_time
from hivenet_router.router.waitqueue import CapacityQueue, PendingQueue


async def test_woken_then_cancelled_waiter_passes_the_wakeup_on() -> None:
    queue = CapacityQueue(5)
    first = asyncio.create_task(queue.wait())
    second = asyncio.create_task(queue.wait())
    await asyncio.sleep(0)
    queue.wake_one()
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    await asyncio.wait_for(second, 1)


def test_pending_queue_bounds_and_times_out() -> None:
    clock = ManualClock()

    async def run() -> None:
        pending = PendingQueue(size=1, max_concurrent=1)
        assert await pending.enter(0.1)
        await pending.take_slot()
        assert await pending.enter(0.1)  # waits for a slot
        taker = asyncio.create_task(pending.take_slot())
        await asyncio.sleep(0)
        started = clock.monotonic()
        assert not await pending.enter(5.0)  # the queue is full: gives up after 5 s
        assert clock.monotonic() - started == 5.0
        pending.release_slot()
        await taker
        assert (pending.waiting, pending.forwarding) == (0, 1)

    run_in_virtual_time(clock, run())
