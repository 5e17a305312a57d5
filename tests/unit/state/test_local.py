"""The in-process state ports: buckets, daily totals, pools and leases, without a network.

Time is a ManualClock that also drives the event loop (run_in_virtual_time): waiting in a
pool's line for its park timeout takes no real time.
"""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hivenet_router.clock import ManualClock, run_in_virtual_time
from hivenet_router.state.local import DailyCounter, LocalPool, RateCounter


async def test_a_rate_refills_continuously_and_reports_what_is_left() -> None:
    clock = ManualClock()
    rates = RateCounter(clock)
    assert (await rates.charge("t", 1, 2)).remaining == 1
    assert (await rates.charge("t", 1, 2)).ok
    third = await rates.charge("t", 1, 2)
    assert not third.ok and third.remaining == 0
    clock.advance(30)  # half a minute refills one of two per minute
    assert (await rates.charge("t", 1, 2)).ok
    assert (await rates.charge("other", 1, 2)).ok  # per key
    assert (await rates.charge("t", 10**9, 0)).ok  # 0: unlimited


async def test_a_burst_window_shrinks_the_bucket() -> None:
    rates = RateCounter(ManualClock(), burst_seconds=6)
    assert all([(await rates.charge("t", 1, 60)).ok for _ in range(6)])  # 6 s of 60/min
    assert not (await rates.charge("t", 1, 60)).ok


async def test_an_answer_puts_a_rate_into_debt_that_refills_on_a_moving_clock() -> None:
    clock = ManualClock()
    rates = RateCounter(clock)
    await rates.adjust("k", 150, 100)  # 150 output tokens against 100 a minute
    assert await rates.left("k", 100) == -50  # in debt: nothing passes
    assert not (await rates.charge("k", 1, 100)).ok
    clock.advance(30)  # half a minute pays the debt back, no more
    assert await rates.left("k", 100) == pytest.approx(0)
    assert not (await rates.charge("k", 1, 100)).ok
    clock.advance(1.2)
    assert (await rates.charge("k", 1, 100)).ok
    await rates.adjust("k", 500, 100)
    assert await rates.left("k", 100) == pytest.approx(-100)  # never deeper than a bucket
    await rates.adjust("k", -1000, 100)
    assert await rates.left("k", 100) == 100  # and never beyond a full bucket


@given(
    capacity=st.integers(min_value=1, max_value=1000),
    steps=st.lists(
        st.tuples(st.floats(min_value=0, max_value=120), st.integers(min_value=1, max_value=50)),
        max_size=40,
    ),
)
def test_a_bucket_stays_within_nothing_and_full(
    capacity: int, steps: list[tuple[float, int]]
) -> None:
    async def run() -> None:
        clock = ManualClock()
        rates = RateCounter(clock)
        level = float(capacity)
        for wait, amount in steps:
            clock.advance(wait)
            before = min(float(capacity), level + wait * capacity / 60)
            verdict = await rates.charge("k", amount, capacity)
            level = await rates.left("k", capacity)
            assert 0 <= level <= capacity
            assert verdict.ok == (before >= amount)

    asyncio.run(run())


async def test_daily_totals_charge_true_up_and_reset_at_utc_midnight() -> None:
    clock = ManualClock(wall_start=1_700_006_400.0)  # 2023-11-15 00:00 UTC
    daily = DailyCounter(clock)
    assert (await daily.charge("t", 600, 1000)).remaining == 400
    refused = await daily.charge("t", 500, 1000)
    assert not refused.ok and refused.remaining == 400
    await daily.adjust("t", -300, 1000)  # the answer used less than the worst case
    assert (await daily.charge("t", 500, 1000)).ok
    assert daily.today() == ("2023-11-15", {"t": 800})
    clock.advance(86_400)
    assert daily.used("t") == 0 and (await daily.charge("t", 1000, 1000)).ok
    assert len(daily) == 2
    daily.sweep()
    assert len(daily) == 1  # yesterday is forgotten
    assert (await daily.charge("u", 10**9, 0)).ok  # 0: unlimited


def test_a_pool_parks_in_line_then_refuses_and_releases_once() -> None:
    clock = ManualClock()

    async def run() -> None:
        pool = LocalPool(clock, alone_fits=True)
        first = await pool.reserve("m", 800, 900, wait=0.25)
        assert first is not None and pool.held("m") == 800
        started = clock.monotonic()
        assert await pool.reserve("m", 800, 900, wait=0.25) is None  # parked, then gave up
        assert clock.monotonic() - started == pytest.approx(0.25)
        waiter = asyncio.create_task(pool.reserve("m", 800, 900, wait=10))
        await asyncio.sleep(1)
        assert not waiter.done()
        first.release()
        first.release()  # a second release gives nothing back twice
        second = await waiter
        assert second is not None and list(pool.levels()) == [("m", 800, 1)]
        async with second:
            second.grow(50)
            assert pool.held("m") == 850
        assert list(pool.levels()) == [("m", 0, 0)]

    run_in_virtual_time(clock, run())


async def test_alone_in_the_pool_an_oversized_reservation_fits_unless_it_is_a_share() -> None:
    clock = ManualClock()
    occupancy = LocalPool(clock, alone_fits=True)
    assert await occupancy.reserve("m", 5000, 900, wait=0) is not None
    shares = LocalPool(clock, alone_fits=False)
    assert await shares.reserve("k", 5000, 900, wait=0) is None


async def test_the_count_backstop() -> None:
    pool = LocalPool(ManualClock(), alone_fits=True)
    held = await pool.reserve("m", 1, 0, wait=0, most=1)
    assert held is not None
    assert await pool.reserve("m", 1, 0, wait=0, most=1) is None
    held.release()
    assert await pool.reserve("m", 1, 0, wait=0, most=1) is not None


async def test_idle_pools_are_forgotten_after_fifteen_minutes() -> None:
    clock = ManualClock()
    pool = LocalPool(clock, alone_fits=True)
    lease = await pool.reserve("m", 10, 100, wait=0)
    assert lease is not None
    clock.advance(3600)
    pool.sweep()
    assert len(pool) == 1  # still held
    lease.release()
    clock.advance(14 * 60)
    pool.sweep()
    assert len(pool) == 1
    clock.advance(61)
    pool.sweep()
    assert len(pool) == 0


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["reserve", "grow", "end"]),
            st.integers(min_value=0, max_value=9),
            st.integers(min_value=-50, max_value=400),
        ),
        max_size=60,
    )
)
def test_pool_arithmetic_under_any_interleaving(steps: list[tuple[str, int, int]]) -> None:
    """Whatever the order of reservations, growth and endings: the pool never admits past
    its budget or its backstop, nothing goes negative, and it is empty once every lease is
    released."""

    async def run() -> None:
        pool = LocalPool(ManualClock(), alone_fits=True)
        held: dict[int, object] = {}
        for action, slot, amount in steps:
            if action == "reserve" and slot not in held:
                levels = dict((k, (t, n)) for k, t, n in pool.levels())
                tokens, count = levels.get("m", (0, 0))
                lease = await pool.reserve("m", abs(amount), 900, wait=0, most=3)
                if lease is not None:
                    held[slot] = lease
                    assert count < 3
                    assert count == 0 or tokens + abs(amount) <= 900
            elif action == "grow" and slot in held:
                held[slot].grow(amount)  # type: ignore[attr-defined]
            elif action == "end" and slot in held:
                held.pop(slot).release()  # type: ignore[attr-defined]
            for _, _, count in pool.levels():
                assert count >= 0
        for lease in held.values():
            lease.release()  # type: ignore[attr-defined]
        assert all((t, n) == (0, 0) for _, t, n in pool.levels())

    asyncio.run(run())


async def test_room_freed_at_once_admits_everyone_in_line_who_fits() -> None:
    pool = LocalPool(ManualClock(), alone_fits=False)
    big = await pool.reserve("m", 100, 100, 5)
    assert big is not None
    small = [asyncio.create_task(pool.reserve("m", 10, 100, 5)) for _ in range(3)]
    await asyncio.sleep(0)
    big.release()
    leases = await asyncio.wait_for(asyncio.gather(*small), 1)
    assert all(lease is not None for lease in leases)


async def test_one_woken_that_still_does_not_fit_keeps_its_place() -> None:
    pool = LocalPool(ManualClock(), alone_fits=False)
    a = await pool.reserve("m", 60, 100, 5)
    b = await pool.reserve("m", 40, 100, 5)
    assert a is not None and b is not None
    large = asyncio.create_task(pool.reserve("m", 90, 100, 5))  # first in line
    await asyncio.sleep(0)
    small = asyncio.create_task(pool.reserve("m", 10, 100, 5))
    await asyncio.sleep(0)
    b.release()  # 40 free: not enough for the first in line, who stays first
    await asyncio.sleep(0.01)
    assert not large.done() and not small.done()
    a.release()
    assert await asyncio.wait_for(large, 1) is not None
    lease = await asyncio.wait_for(small, 1)
    assert lease is not None  # 90 + 10 fit together


async def test_when_the_head_of_the_line_gives_up_the_next_one_looks() -> None:
    pool = LocalPool(ManualClock(), alone_fits=False)
    a = await pool.reserve("m", 60, 100, 5)
    assert a is not None
    large = asyncio.create_task(pool.reserve("m", 90, 100, 0.05))  # gives up soon
    await asyncio.sleep(0)
    small = asyncio.create_task(pool.reserve("m", 10, 100, 5))  # fits, but waits its turn
    await asyncio.sleep(0)
    assert await asyncio.wait_for(large, 1) is None
    lease = await asyncio.wait_for(small, 0.5)  # not left waiting for the next release
    assert lease is not None


@given(
    capacity=st.integers(min_value=1, max_value=1000),
    steps=st.lists(
        st.tuples(
            st.floats(min_value=0, max_value=120),
            st.integers(min_value=1, max_value=50),
            st.integers(min_value=-2000, max_value=2000),
        ),
        max_size=40,
    ),
)
def test_debt_stays_within_one_bucket_and_refuses_every_charge(
    capacity: int, steps: list[tuple[float, int, int]]
) -> None:
    async def run() -> None:
        clock = ManualClock()
        rates = RateCounter(clock)
        for wait, amount, usage in steps:
            clock.advance(wait)
            before = await rates.left("k", capacity)
            verdict = await rates.charge("k", amount, capacity)
            assert verdict.ok == (before >= amount)
            await rates.adjust("k", usage, capacity)  # exact usage over or under the charge
            level = await rates.left("k", capacity)
            assert -capacity <= level <= capacity

    asyncio.run(run())
