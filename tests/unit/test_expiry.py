"""Deadlines: the running task's deadline, told apart from anyone else's cancel, on one
loop timer per slot of time."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from hivenet_router.clock import ManualClock, run_in_virtual_time
from hivenet_router.expiry import Deadlines, Watch


async def guarded(deadlines: Deadlines, after: float | None, work: float) -> str:
    """Sleep `work` seconds under a deadline; say how it ended."""
    try:
        with deadlines.after(after):
            await asyncio.sleep(work)
    except TimeoutError:
        return "timed out"
    return "done"


async def test_work_within_the_deadline_is_left_alone_and_forgotten() -> None:
    deadlines = Deadlines()
    assert await guarded(deadlines, 1.0, 0.01) == "done"
    assert deadlines.pending == 0
    assert deadlines.slots == 0  # the slot and its timer went with its last deadline


async def test_the_deadline_cancels_and_is_told_apart() -> None:
    deadlines = Deadlines()
    loop = asyncio.get_running_loop()
    started = loop.time()
    task = asyncio.create_task(guarded(deadlines, 0.1, 5.0))
    assert await asyncio.wait_for(task, 2.0) == "timed out"
    assert loop.time() - started >= 0.1  # never early
    assert task.cancelling() == 0  # the cancel was withdrawn
    assert deadlines.pending == 0


async def test_many_deadlines_in_one_slot_share_it_and_each_fires() -> None:
    deadlines = Deadlines(grain=0.05)
    tasks = [asyncio.create_task(guarded(deadlines, 0.02, 5.0)) for _ in range(20)]
    keep = [asyncio.create_task(guarded(deadlines, 5.0, 0.2)) for _ in range(3)]
    await asyncio.sleep(0)
    assert deadlines.pending == 23
    assert await asyncio.wait_for(asyncio.gather(*tasks), 2.0) == ["timed out"] * 20
    assert await asyncio.wait_for(asyncio.gather(*keep), 2.0) == ["done"] * 3
    assert deadlines.pending == 0 and deadlines.slots == 0


async def test_no_deadline_never_fires() -> None:
    deadlines = Deadlines()
    assert await guarded(deadlines, None, 0.02) == "done"
    assert await guarded(deadlines, 0, 0.02) == "done"


async def test_a_deadline_already_past_cancels_at_the_next_turn() -> None:
    deadlines = Deadlines()
    loop = asyncio.get_running_loop()

    async def past() -> str:
        try:
            with deadlines.start(loop.time() - 1.0):
                await asyncio.sleep(1.0)
        except TimeoutError:
            return "timed out"
        return "done"

    assert await asyncio.wait_for(past(), 2.0) == "timed out"


async def test_a_cancel_from_outside_stays_a_cancel() -> None:
    deadlines = Deadlines()
    task = asyncio.create_task(guarded(deadlines, 5.0, 5.0))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert deadlines.pending == 0


async def test_an_outside_cancel_together_with_the_deadline_stays_a_cancel() -> None:
    deadlines = Deadlines()

    async def both() -> None:
        with deadlines.after(0.01):
            with contextlib.suppress(asyncio.CancelledError):  # swallowed, as a handler might
                await asyncio.sleep(0.5)  # the deadline fires here
            current = asyncio.current_task()
            assert current is not None
            current.cancel()  # and someone else cancels too
            await asyncio.sleep(1.0)

    task = asyncio.create_task(both())
    with pytest.raises(asyncio.CancelledError):  # not TimeoutError
        await task


async def test_cancel_before_the_slot_comes_leaves_the_task_alone() -> None:
    deadlines = Deadlines()
    expiry = deadlines.after(0.01)
    expiry.cancel()
    await asyncio.sleep(0.1)  # the slot's timer runs here and finds nobody
    assert not expiry.fired


def test_it_needs_a_running_task_and_a_positive_grain() -> None:
    with pytest.raises(RuntimeError):
        Deadlines().start(None)
    with pytest.raises(ValueError):
        Deadlines(grain=0)


async def test_a_deadline_turned_into_another_error_is_still_withdrawn() -> None:
    deadlines = Deadlines()

    async def converts() -> int:
        try:
            with deadlines.after(0.01):
                try:
                    await asyncio.sleep(1.0)
                except asyncio.CancelledError:
                    raise LookupError("handled as something else") from None
        except LookupError:
            pass
        current = asyncio.current_task()
        assert current is not None
        return current.cancelling()

    assert await asyncio.wait_for(converts(), 2.0) == 0


async def test_the_parts_can_be_used_by_hand() -> None:
    deadlines = Deadlines()
    expiry = deadlines.after(0.01)
    try:
        await asyncio.sleep(1.0)
    except asyncio.CancelledError:
        assert expiry.caused()  # its own cancel, withdrawn
    finally:
        expiry.cancel()
    current = asyncio.current_task()
    assert current is not None and current.cancelling() == 0


def _watched(gaps: list[float], idle: float, end: float) -> tuple[str, float, bool]:
    """Chunks arrive after each of `gaps` (virtual seconds) under a Watch; how it ended,
    when, and whether the watch says its end (not idleness) ran out."""
    clock = ManualClock()

    async def main() -> tuple[str, float, bool]:
        loop = asyncio.get_running_loop()
        deadlines = Deadlines()
        start = loop.time()
        watch = Watch(start, idle, start + end)
        outcome = "done"
        try:
            with deadlines.watch(watch):
                for gap in gaps:
                    await asyncio.sleep(gap)
                    watch.last = loop.time()
        except TimeoutError:
            outcome = "timed out"
        assert deadlines.pending == 0 and deadlines.slots == 0
        return outcome, loop.time() - start, watch.ended(loop.time())

    return run_in_virtual_time(clock, main())


def test_a_watch_moves_with_progress_past_its_first_due_time() -> None:
    # 100 steps of 0.9 s under a 1 s idle limit: 90 s in all, never idle for 1 s.
    outcome, at, _ = _watched([0.9] * 100, idle=1.0, end=600.0)
    assert outcome == "done" and at == pytest.approx(90.0)


def test_a_watch_fires_after_a_gap_longer_than_idle() -> None:
    outcome, at, ended = _watched([0.5, 0.5, 30.0], idle=2.0, end=600.0)
    assert outcome == "timed out" and not ended
    assert 3.0 <= at <= 3.0 + 0.1  # never early, at most a grain or two late


def test_a_watch_ends_at_its_end_however_busy() -> None:
    outcome, at, ended = _watched([0.1] * 1000, idle=1.0, end=5.0)
    assert outcome == "timed out" and ended
    assert 5.0 <= at <= 5.1


def test_a_watch_without_idle_counts_only_its_end() -> None:
    outcome, at, ended = _watched([4.0, 4.0], idle=0.0, end=6.0)
    assert outcome == "timed out" and ended and 6.0 <= at <= 6.1
