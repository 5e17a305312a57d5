"""Expiry: a deadline for the running task that tells its own cancel from anyone else's."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from hivenet_router.expiry import Expiry


async def guarded(expiry_after: float | None, work: float) -> str:
    """Sleep `work` seconds under a deadline; say how it ended."""
    expiry = Expiry.after(expiry_after)
    try:
        try:
            await asyncio.sleep(work)
        except asyncio.CancelledError:
            if expiry.caused():
                raise TimeoutError from None
            raise
        finally:
            expiry.cancel()
    except TimeoutError:
        return "timed out"
    return "done"


async def test_work_within_the_deadline_is_left_alone() -> None:
    assert await guarded(1.0, 0.01) == "done"


async def test_the_deadline_cancels_and_is_told_apart() -> None:
    task = asyncio.create_task(guarded(0.01, 5.0))
    assert await asyncio.wait_for(task, 2.0) == "timed out"
    assert task.cancelling() == 0  # the cancel was withdrawn


async def test_no_deadline_never_fires() -> None:
    assert await guarded(None, 0.02) == "done"
    assert await guarded(0, 0.02) == "done"


async def test_a_deadline_already_past_cancels_at_the_next_turn() -> None:
    loop = asyncio.get_running_loop()

    async def past() -> bool:
        expiry = Expiry(loop.time() - 1.0)
        try:
            await asyncio.sleep(1.0)
        except asyncio.CancelledError:
            return expiry.caused()
        finally:
            expiry.cancel()
        return False

    assert await asyncio.wait_for(past(), 2.0)


async def test_a_cancel_from_outside_stays_a_cancel() -> None:
    task = asyncio.create_task(guarded(5.0, 5.0))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_an_outside_cancel_together_with_the_deadline_stays_a_cancel() -> None:
    seen: list[bool] = []

    async def both() -> None:
        expiry = Expiry(asyncio.get_running_loop().time() + 0.01)
        with contextlib.suppress(asyncio.CancelledError):  # swallowed, as a handler might
            await asyncio.sleep(0.1)  # the deadline fires here
        current = asyncio.current_task()
        assert current is not None
        current.cancel()  # and someone else cancels too
        try:
            await asyncio.sleep(1.0)
        except asyncio.CancelledError:
            seen.append(expiry.caused())
            raise
        finally:
            expiry.cancel()

    with pytest.raises(asyncio.CancelledError):
        await asyncio.create_task(both())
    assert seen == [False]


async def test_cancel_stops_the_timer() -> None:
    expiry = Expiry(asyncio.get_running_loop().time() + 0.01)
    expiry.cancel()
    await asyncio.sleep(0.05)  # the task would have been cancelled here
    assert not expiry.fired


def test_it_needs_a_running_task() -> None:
    with pytest.raises(RuntimeError):
        Expiry(None)
