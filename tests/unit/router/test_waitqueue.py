from __future__ import annotations

import asyncio
import math
from collections import Counter
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hivenet_router.clock import ManualClock, run_in_virtual_time
from hivenet_router.router.waitqueue import CapacityQueue, PendingQueue, Place


async def _serve(queue: CapacityQueue, place: Place, woken: list[Place]) -> None:
    await queue.wait(place)
    woken.append(place)


async def _line_up(
    queue: CapacityQueue,
    woken: list[Place],
    tenant: str,
    costs: list[float],
    weight: float = 1.0,
) -> list[asyncio.Task[None]]:
    """Queue one request per cost for the tenant, in order, and let them all start waiting."""
    tasks = [
        asyncio.create_task(_serve(queue, queue.place(tenant, weight, cost), woken))
        for cost in costs
    ]
    await asyncio.sleep(0)
    return tasks


async def _wake(queue: CapacityQueue, times: int) -> None:
    for _ in range(times):
        queue.wake_one()
        await asyncio.sleep(0)  # the woken task runs before the next wake-up


async def _everyone_woken(queue: CapacityQueue, places: list[Place]) -> None:
    """The places wait, then a wake-up for everyone (an agent joined) wakes them all."""
    waits = [asyncio.create_task(queue.wait(place)) for place in places]
    await asyncio.sleep(0)
    queue.wake_all()
    await asyncio.gather(*waits)


async def _finish(queue: CapacityQueue, tasks: list[asyncio.Task[None]]) -> None:
    queue.wake_all()
    await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 5)


async def test_woken_then_cancelled_waiter_passes_the_wakeup_on() -> None:
    queue = CapacityQueue(5)
    first = asyncio.create_task(queue.wait(queue.place()))
    second = asyncio.create_task(queue.wait(queue.place()))
    await asyncio.sleep(0)
    queue.wake_one()
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    await asyncio.wait_for(second, 1)
    assert len(queue) == 0


async def test_a_late_tenant_is_not_stuck_behind_a_backlog() -> None:
    queue = CapacityQueue(1000)
    woken: list[Place] = []
    tasks = await _line_up(queue, woken, "a", [100] * 100)
    tasks += await _line_up(queue, woken, "b", [100] * 5)
    assert queue.waiting_by_tenant() == {"a": 100, "b": 5}
    await _wake(queue, 10)
    assert [place.tenant for place in woken] == ["a", "b"] * 5
    await _finish(queue, tasks)


async def test_service_splits_by_weight() -> None:
    queue = CapacityQueue(1000)
    woken: list[Place] = []
    # Uneven costs: the split is of tokens, not of requests.
    tasks = await _line_up(queue, woken, "heavy", [50, 100, 200, 400] * 100, weight=3)
    tasks += await _line_up(queue, woken, "light", [400, 25, 100, 300] * 100, weight=1)
    await _wake(queue, 400)
    service: Counter[str] = Counter()
    for place in woken:
        service[place.tenant] += int(place.cost)
    assert 2.8 < service["heavy"] / service["light"] < 3.2
    await _finish(queue, tasks)


async def test_each_tenant_is_served_in_arrival_order() -> None:
    queue = CapacityQueue(100)
    woken: list[Place] = []
    tasks = await _line_up(queue, woken, "a", [300, 1, 50])
    tasks += await _line_up(queue, woken, "b", [1, 1, 1, 1])
    tasks += await _line_up(queue, woken, "a", [1, 1])
    await _wake(queue, 3)
    tasks += await _line_up(queue, woken, "a", [1])
    await _wake(queue, 7)
    costs = [place.cost for place in woken if place.tenant == "a"]
    assert costs == [300, 1, 50, 1, 1, 1]
    tags = [place.tag for place in woken]
    assert all(tag is not None for tag in tags)
    assert tags == sorted(tags, key=lambda tag: tag or 0.0)  # the virtual time never goes back
    await _finish(queue, tasks)


async def test_an_idle_tenant_gets_no_credit_for_the_idle_time() -> None:
    queue = CapacityQueue(1000)
    woken: list[Place] = []
    tasks = await _line_up(queue, woken, "busy", [10] * 100)
    await _wake(queue, 50)
    tasks += await _line_up(queue, woken, "idle", [10] * 10)
    del woken[:]
    await _wake(queue, 10)
    assert Counter(place.tenant for place in woken) == {"busy": 5, "idle": 5}
    await _finish(queue, tasks)


async def _newcomer_after(
    queue: CapacityQueue, rewait: list[Place], served: list[Place], newcomer: str
) -> Counter[str]:
    """After a wake-up for everyone: `rewait` wait again, `served` take slots, then a new
    tenant lines up ten requests of cost 10. The tenants of the next ten woken."""
    woken: list[Place] = []
    tasks = [asyncio.create_task(_serve(queue, place, woken)) for place in rewait]
    await asyncio.sleep(0)
    for place in served:
        queue.served(place)
    tasks += await _line_up(queue, woken, newcomer, [10] * 10)
    await _wake(queue, 10)
    await _finish(queue, tasks)
    return Counter(place.tenant for place in woken[:10])


async def test_service_after_a_wakeup_for_everyone_moves_the_virtual_time() -> None:
    # An agent joins: everyone wakes, half of them get slots, the rest wait again. A tenant
    # that arrives next must not start below the tags just served, as if they never were.
    queue = CapacityQueue(1000)
    places = [queue.place("busy", cost=10) for _ in range(100)]
    await _everyone_woken(queue, places)
    assert await _newcomer_after(queue, places[50:], places[:50], "late") == {
        "busy": 5,
        "late": 5,
    }


async def test_a_service_far_down_the_order_does_not_jump_the_backlog() -> None:
    # After a wake-up for everyone, a request with a huge cost and a tiny weight takes the
    # slot the ones ahead of it could not use: newcomers must not start behind all of them.
    queue = CapacityQueue(1000)
    ahead = [queue.place("a", cost=10) for _ in range(20)]
    far = queue.place("b", weight=0.001, cost=100)
    await _everyone_woken(queue, [*ahead, far])
    # Half each, give or take the one request the tie at the virtual time goes to; had the
    # virtual time jumped to the far tag, "c" would get none.
    assert (await _newcomer_after(queue, ahead, [far], "c"))["c"] in (4, 5)


async def test_a_rewait_keeps_its_turn() -> None:
    queue = CapacityQueue(10)
    first = queue.place("a")
    waiting = asyncio.create_task(queue.wait(first))
    woken: list[Place] = []
    tasks = await _line_up(queue, woken, "a", [1])
    tasks += await _line_up(queue, woken, "b", [1])
    queue.wake_one()
    await waiting  # woken, but (say) the slot was taken in between
    tag = first.tag
    tasks += await _line_up(queue, woken, "c", [1])
    again = asyncio.create_task(queue.wait(first))
    await asyncio.sleep(0)
    assert len(queue) == 4
    queue.wake_one()
    await asyncio.sleep(0)
    assert again.done()
    assert not woken
    assert first.tag == tag
    await _finish(queue, tasks)


async def test_waiters_woken_together_keep_their_order_when_they_wait_again() -> None:
    queue = CapacityQueue(10)
    places = [queue.place("a"), queue.place("b"), queue.place("a")]
    tasks = [asyncio.create_task(queue.wait(place)) for place in places]
    await asyncio.sleep(0)
    queue.wake_all()
    await asyncio.gather(*tasks)
    woken: list[Place] = []
    tasks = [asyncio.create_task(_serve(queue, place, woken)) for place in reversed(places)]
    tasks += await _line_up(queue, woken, "b", [1])
    await _wake(queue, 3)
    assert woken == places
    await _finish(queue, tasks)


async def test_cancelled_waiters_leave_no_entry_and_no_debt() -> None:
    queue = CapacityQueue(100)
    woken: list[Place] = []
    doomed = await _line_up(queue, woken, "a", [100] * 20)
    tasks = await _line_up(queue, woken, "b", [100] * 20)
    doomed[5].cancel()  # behind the front of its line
    doomed[0].cancel()  # at the front
    await asyncio.sleep(0)
    assert len(queue) == 38
    assert queue.waiting_by_tenant() == {"a": 18, "b": 20}
    await _wake(queue, 2)
    assert [place.tenant for place in woken] == ["a", "b"]
    for task in doomed:  # the rest hit their deadline
        task.cancel()
    await asyncio.gather(*doomed, return_exceptions=True)
    assert queue.waiting_by_tenant() == {"b": 19}
    # Requests that were never served cost their tenant nothing: its next one is not
    # pushed behind b's backlog.
    tasks += await _line_up(queue, woken, "a", [100])
    await _wake(queue, 2)
    assert [place.tenant for place in woken[2:]] == ["b", "a"]
    await _finish(queue, tasks)
    assert len(queue) == 0


async def test_a_place_cancelled_before_its_turn_waits_again_as_a_newcomer() -> None:
    queue = CapacityQueue(10)
    place = queue.place("a")
    waiting = asyncio.create_task(queue.wait(place))
    woken: list[Place] = []
    tasks = await _line_up(queue, woken, "b", [1])
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    assert place.tag is None
    tasks.append(asyncio.create_task(_serve(queue, place, woken)))
    await asyncio.sleep(0)
    await _wake(queue, 2)
    assert [woken_place.tenant for woken_place in woken] == ["b", "a"]
    await _finish(queue, tasks)


async def test_a_wakeup_skips_a_waiter_cancelled_but_not_yet_run() -> None:
    queue = CapacityQueue(10)
    first = asyncio.create_task(queue.wait(queue.place("a")))
    second = asyncio.create_task(queue.wait(queue.place("b")))
    await asyncio.sleep(0)
    first.cancel()
    queue.wake_one()  # before the cancelled task gets to run
    assert len(queue) == 0
    await asyncio.wait_for(second, 1)
    await asyncio.gather(first, return_exceptions=True)
    assert queue.waiting_by_tenant() == {}


async def test_a_queue_holds_nothing_for_tenants_with_nobody_waiting() -> None:
    queue = CapacityQueue(100_000)
    woken: list[Place] = []
    steady = await _line_up(queue, woken, "steady", [10, 10])
    for wave in range(20):
        tasks = [
            asyncio.create_task(_serve(queue, queue.place(f"t{wave}-{n}", 1 + n % 3, n), woken))
            for n in range(500)
        ]
        await asyncio.sleep(0)
        for task in tasks[::2]:
            task.cancel()
        await asyncio.sleep(0)
        while not all(task.done() for task in tasks):
            await _wake(queue, 1)
        steady += await _line_up(queue, woken, "steady", [10] * 10)
        # Only the tenant still waiting is known; the heap holds little beyond the live.
        assert queue._lines.keys() == {"steady"}
        assert queue._counts.keys() == {"steady"}
        assert len(queue._heap) <= 2 * len(queue) + 34
    await _finish(queue, steady)
    assert len(queue) == 0
    assert (queue._lines, queue._counts, queue._heap) == ({}, {}, [])


async def test_cancellations_do_not_pile_up_behind_a_waiter_that_stays() -> None:
    queue = CapacityQueue(100_000)
    woken: list[Place] = []
    stays = await _line_up(queue, woken, "a", [1])
    for _ in range(5):
        behind = await _line_up(queue, woken, "a", [1] * 200)
        elsewhere = [
            asyncio.create_task(_serve(queue, queue.place(f"t{n}"), woken)) for n in range(200)
        ]
        await asyncio.sleep(0)
        for task in behind + elsewhere:
            task.cancel()
        await asyncio.gather(*behind, *elsewhere, return_exceptions=True)
        assert len(queue) == 1
        # Lazy deletion, but bounded: the entries left are few beyond the one live waiter.
        assert len(queue._lines["a"].entries) <= 20
        assert len(queue._heap) <= 40
    await _finish(queue, stays)
    assert [place.tenant for place in woken] == ["a"]
    assert len(queue) == 0


async def test_places_are_checked() -> None:
    queue = CapacityQueue(1)
    for weight in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="weight"):
            queue.place("a", weight)
    for cost in (math.nan, math.inf):
        with pytest.raises(ValueError, match="cost"):
            queue.place("a", 1.0, cost)
    with pytest.raises(ValueError, match="range"):
        queue.place("a", 1e-308, 1e10)
    assert queue.place("a", 2.0, 0.0).cost == 1.0
    with pytest.raises(ValueError, match="another queue"):
        await CapacityQueue(1).wait(queue.place())
    place = queue.place()
    waiting = asyncio.create_task(queue.wait(place))
    await asyncio.sleep(0)
    assert queue.full
    with pytest.raises(RuntimeError, match="already waiting"):
        await queue.wait(place)
    queue.wake_one()
    await waiting
    assert not queue.full


@dataclass
class _Request:
    place: Place
    index: int  # arrival order within its tenant
    rewaits: int
    state: str = "new"
    wakes: int = 0
    task: asyncio.Task[None] | None = field(default=None, repr=False)


async def _request(queue: CapacityQueue, request: _Request, first_wakes: list[_Request]) -> None:
    for _ in range(request.rewaits + 1):
        request.state = "waiting"
        try:
            await queue.wait(request.place)
        except asyncio.CancelledError:
            request.state = "cancelled"
            raise
        request.wakes += 1
        if request.wakes == 1:
            first_wakes.append(request)
    request.state = "done"
    queue.served(request.place)  # as the dispatcher does when a woken request takes a slot


def _check_structure(queue: CapacityQueue) -> None:
    """Every queued waiter can be reached: it is in the heap or behind its line's front."""
    in_heap = [entry[3] for entry in queue._heap]
    assert all(waiter.in_heap for waiter in in_heap)
    assert queue._stale == sum(not waiter.queued for waiter in in_heap)
    reachable = sum(waiter.queued for waiter in in_heap)
    for line in queue._lines.values():
        front = line.entries[0]
        assert front.queued and front.in_heap and front.place.tag is not None
        assert line.live == sum(waiter.queued for waiter in line.entries)
        reachable += line.live - 1
    assert reachable == len(queue)
    # No newcomer's turn is behind the virtual time: neither a wake-up nor a service moves
    # it past a tag still waiting in its tenant's line.
    for tag, _, _, waiter in queue._heap:
        assert not (waiter.queued and waiter.in_line) or tag >= queue._virtual


class _Scenario:
    def __init__(self) -> None:
        self.queue = CapacityQueue(1000)
        self.requests: list[_Request] = []
        self.first_wakes: list[_Request] = []
        self.issued = 0  # wake-ups handed out
        self.dirty = False  # a cancellation has not run yet

    def waiting(self) -> list[_Request]:
        return [request for request in self.requests if request.state == "waiting"]

    def arrive(self, tenant: str, weight: float, cost: int, rewaits: int) -> None:
        index = sum(request.place.tenant == tenant for request in self.requests)
        request = _Request(self.queue.place(tenant, weight, cost), index, rewaits)
        request.task = asyncio.create_task(_request(self.queue, request, self.first_wakes))
        self.requests.append(request)

    def cancel(self, pick: int) -> None:
        live = [request for request in self.requests if request.state in ("new", "waiting")]
        if live and (task := live[pick % len(live)].task) is not None:
            task.cancel()
            self.dirty = True

    def wake_one(self) -> None:
        before = len(self.queue)
        self.queue.wake_one()
        self.issued += 1
        if before:
            assert len(self.queue) == before - 1 or (self.dirty and len(self.queue) < before)

    def wake_all(self) -> None:
        self.issued += len(self.queue)
        self.queue.wake_all()
        assert len(self.queue) == 0

    async def settle(self) -> None:
        for _ in range(4):
            await asyncio.sleep(0)
        self.dirty = False
        waiting = self.waiting()
        assert len(self.queue) == len(waiting)
        assert self.queue.waiting_by_tenant() == Counter(r.place.tenant for r in waiting)

    def check(self) -> None:
        assert sum(self.queue.waiting_by_tenant().values()) == len(self.queue)
        _check_structure(self.queue)
        assert len(self.queue) <= len(self.waiting())
        # Each wake-up reaches one waiter at most: none is woken twice.
        assert sum(request.wakes for request in self.requests) <= self.issued

    def check_order(self) -> None:
        last: dict[str, int] = {}
        for request in self.first_wakes:
            assert request.index > last.get(request.place.tenant, -1)
            last[request.place.tenant] = request.index
        # Within a tenant tags only grow. Across tenants they need not: a wake-up of
        # everyone is not service, so a tenant arriving after one starts below the tags
        # it handed out.
        by_tenant: dict[str, list[float]] = {}
        for request in self.first_wakes:
            by_tenant.setdefault(request.place.tenant, []).append(request.place.tag or 0.0)
        for tags in by_tenant.values():
            assert tags == sorted(tags)


async def _play(steps: list[tuple[str, int, int]]) -> None:
    scenario = _Scenario()
    for kind, a, b in steps:
        if kind == "arrive":
            scenario.arrive("xyz"[a % 3], (1.0, 2.5)[a % 2], b, b % 3)
            await asyncio.sleep(0)  # it starts waiting; cancelled or woken ones may move on
        elif kind == "cancel":
            scenario.cancel(a)
        elif kind == "wake_one":
            scenario.wake_one()
        elif kind == "wake_all":
            scenario.wake_all()
        else:
            await scenario.settle()
        scenario.check()
    await scenario.settle()
    for _ in range(4):  # each round wakes everyone; a request re-waits at most twice
        scenario.wake_all()
        await scenario.settle()
    assert all(request.task is not None and request.task.done() for request in scenario.requests)
    scenario.check_order()
    queue = scenario.queue
    assert (len(queue), queue._lines, queue._counts, queue._heap) == (0, {}, {}, [])


_STEP = st.tuples(
    st.sampled_from(["arrive", "arrive", "arrive", "cancel", "wake_one", "wake_all", "settle"]),
    st.integers(0, 50),
    st.integers(0, 300),
)


@settings(max_examples=200, deadline=None, database=None)
@given(st.lists(_STEP, min_size=20, max_size=100))
def test_any_interleaving_keeps_the_count_exact_and_wakes_nobody_twice(
    steps: list[tuple[str, int, int]],
) -> None:
    asyncio.run(_play(steps))


def test_pending_queue_bounds_and_times_out() -> None:
    clock = ManualClock()

    async def run() -> None:
        pending = PendingQueue(size=1, limit=1)
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
