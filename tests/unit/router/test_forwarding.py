"""The forwarding limit and the global queue: fixed, or following the registered fleet, and
resized while requests are in flight without dropping any."""

from __future__ import annotations

import asyncio

from hypothesis import given
from hypothesis import strategies as st

from hivenet_router.clock import ManualClock, run_in_virtual_time
from hivenet_router.domain.agent import Registration
from hivenet_router.policy.store import PolicyStore
from hivenet_router.router.dispatch import Dispatcher
from hivenet_router.router.forwarding import FLEET_FLOOR, QUEUE_FLOOR, DispatchLimits
from hivenet_router.router.registry import AgentRecord, Registry
from hivenet_router.router.waitqueue import PendingQueue


def record(peer: str, capacity: int, model: str = "m") -> AgentRecord:
    reg = Registration(
        peer_id=peer, model=model, capability="llm", engine="vllm", capacity=capacity
    )
    return AgentRecord(reg=reg, link=None, last_heartbeat=0.0, registered_at=0.0)


def limits(
    max_concurrent: int = 0, queue_size: int = 0, queue_depth: int = 30, ceiling: int = 8192
) -> DispatchLimits:
    return DispatchLimits(queue_size, max_concurrent, 5.0, queue_depth, 3, ceiling)


def test_a_fixed_limit_and_queue_stay_whatever_the_fleet() -> None:
    fleet = [record(f"a{n}", 100) for n in range(6)]
    assert limits(max_concurrent=20, queue_size=7).sizes(fleet) == (7, 20)
    # The queue follows the fixed limit, never below the reference's 100.
    assert limits(max_concurrent=20).sizes(fleet) == (QUEUE_FLOOR, 20)
    assert limits(max_concurrent=500).sizes(fleet) == (500, 500)


def test_the_followed_limit_is_the_fleet_plus_a_queue_per_model_within_its_bounds() -> None:
    assert limits().sizes([]) == (QUEUE_FLOOR, FLEET_FLOOR)
    six = [record(f"a{n}", 10) for n in range(6)]
    assert limits().sizes(six) == (QUEUE_FLOOR, 90)  # 60 slots and one model's 30 waiting
    assert limits(queue_depth=0).sizes(six) == (QUEUE_FLOOR, 60)
    two_models = [*six, record("b", 10, model="other")]
    assert limits().sizes(two_models) == (130, 130)
    assert limits(ceiling=100).sizes(two_models) == (QUEUE_FLOOR, 100)
    assert limits(ceiling=10).sizes(two_models) == (QUEUE_FLOOR, FLEET_FLOOR)
    assert limits(queue_size=3).sizes(two_models) == (3, 130)


@given(
    st.lists(st.tuples(st.integers(1, 1_000_000), st.sampled_from("abc")), max_size=12),
    st.integers(0, 100),
    st.integers(1, 100_000),
)
def test_a_followed_limit_stays_in_bounds_and_grows_with_the_fleet(
    agents: list[tuple[int, str]], depth: int, ceiling: int
) -> None:
    bounds = limits(queue_depth=depth, ceiling=ceiling)
    fleet = [record(f"p{n}", capacity, model) for n, (capacity, model) in enumerate(agents)]
    size, limit = bounds.sizes(fleet)
    assert FLEET_FLOOR <= limit <= max(FLEET_FLOOR, ceiling)
    assert size == max(QUEUE_FLOOR, limit)
    models = {model for _, model in agents}
    if limit < ceiling:
        assert limit == max(FLEET_FLOOR, sum(c for c, _ in agents) + depth * len(models))
    more = bounds.sizes([*fleet, record("new", 1)])
    assert more[1] >= limit and more[0] >= size


def test_the_dispatcher_follows_registrations() -> None:
    registry = Registry()
    dispatcher = Dispatcher(registry, ManualClock(), limits(), PolicyStore())
    pending = dispatcher.pending
    assert (pending.size, pending.limit) == (QUEUE_FLOOR, FLEET_FLOOR)
    for n in range(6):
        registry.upsert(record(f"a{n}", 10))
    assert (pending.size, pending.limit) == (QUEUE_FLOOR, 90)
    registry.upsert(record("a0", 40))  # the same agent, registered again with more slots
    assert pending.limit == 120 and pending.size == 120
    agent = registry.get("a1")
    assert agent is not None
    registry.announce("unhealthy", agent)  # still registered: still counted
    assert pending.limit == 120
    registry.remove("a0")
    assert pending.limit == 80
    for n in range(1, 6):
        registry.remove(f"a{n}")
    assert (pending.size, pending.limit) == (QUEUE_FLOOR, FLEET_FLOOR)


def test_a_fixed_limit_does_not_follow() -> None:
    registry = Registry()
    dispatcher = Dispatcher(registry, ManualClock(), limits(max_concurrent=20), PolicyStore())
    for n in range(6):
        registry.upsert(record(f"a{n}", 10))
    assert (dispatcher.pending.size, dispatcher.pending.limit) == (QUEUE_FLOOR, 20)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_a_lower_limit_keeps_every_forward_in_flight_and_newcomers_wait() -> None:
    clock = ManualClock()

    async def run() -> None:
        started = clock.monotonic()
        pending = PendingQueue(size=4, limit=3)
        for _ in range(3):
            assert await pending.enter(1.0)
            await pending.take_slot()
        pending.resize(4, 1)  # an agent went away: one forward allowed, three in flight
        assert (pending.waiting, pending.forwarding) == (0, 3)
        assert await pending.enter(1.0)
        newcomer = asyncio.create_task(pending.take_slot())
        await settle()
        pending.release_slot()
        pending.release_slot()
        await settle()
        assert not newcomer.done()  # two ended; one still runs, the one allowed
        pending.release_slot()
        await newcomer
        assert (pending.waiting, pending.forwarding) == (0, 1)
        pending.resize(4, 3)  # agents came back: the freed slots are free
        for _ in range(2):
            assert await pending.enter(1.0)
            await pending.take_slot()
        assert pending.forwarding == 3 and clock.monotonic() == started  # nobody waited

    run_in_virtual_time(clock, run())


def test_a_higher_limit_lets_the_waiting_in_at_once() -> None:
    clock = ManualClock()

    async def run() -> None:
        started = clock.monotonic()
        pending = PendingQueue(size=10, limit=1)
        assert await pending.enter(1.0)
        await pending.take_slot()
        for _ in range(3):
            assert await pending.enter(1.0)
        waiting = [asyncio.create_task(pending.take_slot()) for _ in range(3)]
        await settle()
        assert (pending.waiting, pending.forwarding) == (3, 1)
        pending.resize(10, 3)  # two more agent slots: two of the three go
        await settle()
        assert [task.done() for task in waiting] == [True, True, False]
        pending.resize(10, 4)
        await asyncio.gather(*waiting)
        assert (pending.waiting, pending.forwarding) == (0, 4)
        assert clock.monotonic() == started

    run_in_virtual_time(clock, run())


def test_a_smaller_queue_keeps_who_waits_and_times_newcomers_out() -> None:
    clock = ManualClock()

    async def run() -> None:
        pending = PendingQueue(size=3, limit=1)
        assert await pending.enter(5.0)
        await pending.take_slot()
        for _ in range(3):
            assert await pending.enter(5.0)  # three wait for the one slot
        pending.resize(1, 1)
        assert pending.waiting == 3
        started = clock.monotonic()
        assert not await pending.enter(5.0)  # no room: queue_full after the timeout
        assert clock.monotonic() - started == 5.0
        takers = [asyncio.create_task(pending.take_slot()) for _ in range(3)]
        for _ in range(3):
            await settle()
            pending.release_slot()
        await asyncio.gather(*takers)
        # Two of the three places they left paid off the smaller queue: one place is free.
        assert (pending.waiting, pending.forwarding) == (0, 1)
        assert await pending.enter(5.0)
        assert clock.monotonic() - started == 5.0

    run_in_virtual_time(clock, run())
