"""Slots: free slots without an await, waiters in order, nothing lost to cancellation."""

from __future__ import annotations

import asyncio

import pytest

from hivenet_router.slots import Slots


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_free_slots_are_taken_without_waiting() -> None:
    slots = Slots(2)
    assert slots.take() and slots.take()
    assert slots.locked() and not slots.take()
    slots.release()
    assert slots.free == 1 and not slots.locked()


def test_a_negative_count_is_refused() -> None:
    with pytest.raises(ValueError):
        Slots(-1)


async def test_waiters_are_served_in_order_and_a_release_skips_the_free_count() -> None:
    slots = Slots(1)
    assert slots.take()
    order: list[int] = []

    async def waiter(n: int) -> None:
        await slots.acquire()
        order.append(n)

    tasks = [asyncio.create_task(waiter(n)) for n in range(3)]
    await settle()
    assert order == []
    for _ in range(3):
        slots.release()
        # A newcomer finds no free slot while the line is served.
        assert not slots.take()
        await settle()
    assert order == [0, 1, 2]
    await asyncio.gather(*tasks)
    assert slots.free == 0
    slots.release()
    assert slots.free == 1


async def one_taken_and_two_waiting() -> tuple[Slots, asyncio.Task[None], asyncio.Task[None]]:
    slots = Slots(1)
    assert slots.take()
    first = asyncio.create_task(slots.acquire())
    second = asyncio.create_task(slots.acquire())
    await settle()
    return slots, first, second


def served_and_given_back(
    slots: Slots, gone: asyncio.Task[None], stays: asyncio.Task[None]
) -> None:
    """`gone` ended cancelled, `stays` holds the one slot; giving it back frees it."""
    assert gone.cancelled()
    assert stays.done() and not stays.cancelled() and slots.free == 0
    slots.release()
    assert slots.free == 1


async def test_a_cancelled_waiter_leaves_the_line() -> None:
    slots, gone, stays = await one_taken_and_two_waiting()
    gone.cancel()
    await settle()
    slots.release()  # goes to the one still waiting
    await settle()
    served_and_given_back(slots, gone, stays)


async def test_a_waiter_cancelled_after_its_slot_was_handed_over_passes_it_on() -> None:
    slots, first, second = await one_taken_and_two_waiting()
    slots.release()  # hands the slot to `first`, which has not run yet
    first.cancel()  # and is cancelled before it does
    await settle()
    served_and_given_back(slots, first, second)  # the slot went on, not lost


async def test_a_release_between_a_cancel_and_its_wake_up_leaves_a_plain_cancel() -> None:
    slots, gone, stays = await one_taken_and_two_waiting()
    gone.cancel()  # its waiter is cancelled now; the task unwinds at its next turn
    slots.release()  # in the same turn: drops the cancelled waiter, serves `stays`
    await settle()
    # A CancelledError, not an error from leaving the line.
    served_and_given_back(slots, gone, stays)


async def test_fewer_slots_than_taken_keeps_every_holder_and_pays_back_first() -> None:
    slots = Slots(3)
    assert slots.take() and slots.take() and slots.take()
    slots.add(-2)  # one slot left, three held: nobody loses theirs
    assert slots.free == -2 and not slots.take()
    newcomer = asyncio.create_task(slots.acquire())
    await settle()
    slots.release()
    slots.release()  # two given back pay off the two taken away
    await settle()
    assert not newcomer.done() and slots.free == 0
    slots.release()  # the third goes to the one waiting
    await settle()
    assert newcomer.done() and slots.free == 0
    slots.release()
    assert slots.free == 1


async def test_a_waiter_handed_a_slot_that_was_then_taken_away_gives_it_back_to_the_count() -> None:
    slots, first, second = await one_taken_and_two_waiting()
    slots.release()  # handed to `first`, which has not run yet
    slots.add(-1)  # the slot it holds is one too many now
    first.cancel()  # its slot pays off the deficit rather than going to `second`
    await settle()
    assert first.cancelled() and not second.done() and slots.free == 0
    second.cancel()
    await settle()


async def test_more_slots_wake_waiters_in_order_then_count_as_free() -> None:
    slots = Slots(1)
    assert slots.take()
    order: list[int] = []

    async def waiter(n: int) -> None:
        await slots.acquire()
        order.append(n)

    tasks = [asyncio.create_task(waiter(n)) for n in range(3)]
    await settle()
    slots.add(-1)
    slots.add(3)  # pays off one, serves two of the three
    await settle()
    assert order == [0, 1] and slots.free == 0
    slots.add(2)  # serves the third, and one is left free
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2] and slots.free == 1
