"""Selection, slots and waiting, over registry records with stand-in connections."""

from __future__ import annotations

import asyncio

import pytest

from hivenet_router.clock import ManualClock
from hivenet_router.domain.agent import Registration
from hivenet_router.domain.errors import ApiError, ErrorCode
from hivenet_router.policy.document import BUILT_IN
from hivenet_router.policy.store import PolicyStore
from hivenet_router.router.dispatch import (
    Dispatcher,
    DispatchLimits,
    Job,
    Progress,
    _StepExhausted,
)
from hivenet_router.router.health import HealthMonitor
from hivenet_router.router.metrics import RouterMetrics
from hivenet_router.router.registry import AgentRecord, Registry
from hivenet_router.router.waitqueue import CapacityQueue, PendingQueue


class OpenLink:
    closed = False


def record(
    peer: str, capacity: int = 1, model: str = "m", capability: str = "llm", now: float = 1000.0
) -> AgentRecord:
    reg = Registration(
        peer_id=peer, model=model, capability=capability, engine="vllm", capacity=capacity
    )
    return AgentRecord(
        reg=reg,
        link=OpenLink(),  # type: ignore[arg-type]
        session_digest=b"",
        last_heartbeat=now,
        registered_at=0.0,
        meters=RouterMetrics().agent_meters(peer, model),
    )


def setup(queue_depth: int = 2) -> tuple[Registry, Dispatcher, ManualClock]:
    clock = ManualClock()
    metrics = RouterMetrics()
    registry = Registry(metrics)
    limits = DispatchLimits(
        queue_size=10, max_concurrent=10, enqueue_timeout=1.0, queue_depth=queue_depth, max_tries=3
    )
    return registry, Dispatcher(registry, metrics, clock, limits, PolicyStore()), clock


STEP = BUILT_IN.steps[0]
JOB = Job("/v1/chat/completions", "m", "llm", False, b"{}", [])


async def test_least_loaded_then_least_recently_used() -> None:
    registry, dispatcher, _ = setup()
    a, b = record("a", capacity=4), record("b", capacity=2)
    registry.upsert(a)
    registry.upsert(b)
    picks = [(await dispatcher._acquire(JOB, STEP, set())).peer_id for _ in range(6)]
    assert sorted(picks[:2]) == ["a", "b"]
    assert (a.active, b.active) == (4, 2)


async def test_errors_for_missing_and_ineligible_agents() -> None:
    registry, dispatcher, _ = setup()
    with pytest.raises(ApiError) as info:
        await dispatcher._route(JOB, Progress(), BUILT_IN)
    assert info.value.code is ErrorCode.MODEL_NOT_FOUND
    agent = record("a", capability="embedding")
    registry.upsert(agent)
    with pytest.raises(ApiError) as info:
        await dispatcher._route(JOB, Progress(), BUILT_IN)
    assert info.value.code is ErrorCode.NO_AGENTS_AVAILABLE
    ok = record("b")
    registry.upsert(ok)
    with pytest.raises(_StepExhausted):
        await dispatcher._acquire(JOB, STEP, {"b"})
    ok.backend_healthy = False
    with pytest.raises(ApiError) as info:
        await dispatcher._route(JOB, Progress(), BUILT_IN)
    assert info.value.code is ErrorCode.NO_AGENTS_AVAILABLE


async def test_waiters_are_served_in_order_and_bounded() -> None:
    registry, dispatcher, _ = setup(queue_depth=2)
    agent = record("a", capacity=1)
    registry.upsert(agent)
    await dispatcher._acquire(JOB, STEP, set())
    order: list[int] = []

    async def wait(i: int) -> None:
        got = await dispatcher._acquire(JOB, STEP, set())
        order.append(i)
        await asyncio.sleep(0)
        registry.release(got)

    first = asyncio.create_task(wait(1))
    await asyncio.sleep(0)
    second = asyncio.create_task(wait(2))
    await asyncio.sleep(0)
    with pytest.raises(ApiError) as info:
        await dispatcher._route(JOB, Progress(), BUILT_IN)
    assert info.value.code is ErrorCode.NO_CAPACITY
    assert dispatcher.queued("m") == 2
    registry.release(agent)
    await asyncio.gather(first, second)
    assert order == [1, 2]
    assert agent.active == 0 and dispatcher.queued("m") == 0


async def test_a_new_agent_wakes_waiters() -> None:
    registry, dispatcher, _ = setup()
    registry.upsert(record("a"))
    await dispatcher._acquire(JOB, STEP, set())
    waiter = asyncio.create_task(dispatcher._acquire(JOB, STEP, set()))
    await asyncio.sleep(0)
    assert not waiter.done()
    registry.upsert(record("b"))
    assert (await waiter).peer_id == "b"


async def test_cancelled_waiter_leaves_no_entry() -> None:
    registry, dispatcher, _ = setup()
    agent = record("a")
    registry.upsert(agent)
    await dispatcher._acquire(JOB, STEP, set())
    waiter = asyncio.create_task(dispatcher._acquire(JOB, STEP, set()))
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert dispatcher.queued("m") == 0
    registry.release(agent)
    assert agent.active == 0


async def test_woken_then_cancelled_waiter_passes_the_wakeup_on() -> None:
    queue = CapacityQueue(5)
    first = asyncio.create_task(queue.wait())
    second = asyncio.create_task(queue.wait())
    await asyncio.sleep(0)
    queue.wake_one()
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    await asyncio.wait_for(second, 1)


async def test_slot_release_is_checked() -> None:
    agent = record("a")
    assert agent.try_acquire()
    assert not agent.try_acquire()
    agent.release()
    with pytest.raises(RuntimeError):
        agent.release()


async def test_pending_queue_bounds_and_times_out() -> None:
    pending = PendingQueue(size=1, max_concurrent=1)
    assert await pending.enter(0.1)
    await pending.take_slot()
    assert await pending.enter(0.1)  # waits for a slot
    taker = asyncio.create_task(pending.take_slot())
    await asyncio.sleep(0)
    assert not await pending.enter(0.05)  # the queue is full
    pending.release_slot()
    await taker
    assert (pending.waiting, pending.forwarding) == (0, 1)


def test_health_monitor_marks_then_removes() -> None:
    registry, _, clock = setup()
    removed: list[str] = []
    agent = record("a", now=clock.monotonic())
    registry.upsert(agent)
    monitor = HealthMonitor(
        registry,
        RouterMetrics(),
        clock,
        unhealthy_after=15,
        remove_after=30,
        on_remove=lambda r: removed.append(r.peer_id),
    )
    clock.advance(10)
    monitor.sweep()
    assert agent.process_healthy
    clock.advance(6)
    monitor.sweep()
    assert not agent.process_healthy and registry.get("a") is agent
    clock.advance(15)
    monitor.sweep()
    assert registry.get("a") is None and removed == ["a"]


def test_health_monitor_spares_a_reregistered_agent() -> None:
    registry, _, clock = setup()
    old = record("a", now=clock.monotonic())
    registry.upsert(old)
    monitor = HealthMonitor(
        registry,
        RouterMetrics(),
        clock,
        unhealthy_after=15,
        remove_after=30,
        on_remove=lambda r: None,
    )
    clock.advance(31)
    registry.upsert(record("a", now=clock.monotonic()))
    monitor.sweep()
    assert registry.get("a") is not None


class StaleLink:
    """Looks open, but fails the moment a stream is opened: a connection that died quietly."""

    closed = False

    async def open(self, *args: object, **kwargs: object) -> None:
        from hivenet_router.transport.link import LinkClosed

        self.closed = True
        raise LinkClosed("stale")


async def test_a_stale_connection_costs_no_try() -> None:
    clock = ManualClock()
    metrics = RouterMetrics()
    registry = Registry(metrics)
    limits = DispatchLimits(
        queue_size=10, max_concurrent=10, enqueue_timeout=1.0, queue_depth=0, max_tries=1
    )
    dispatcher = Dispatcher(registry, metrics, clock, limits, PolicyStore())
    stale = record("stale")
    stale.link = StaleLink()  # type: ignore[assignment]
    registry.upsert(stale)
    with pytest.raises(ApiError) as info:
        await dispatcher._route(JOB, Progress(), BUILT_IN)
    # The stale agent was dropped without using the single try; the failure reported is the
    # absence of any other agent, with the stale connection named as the last failure.
    assert info.value.code is ErrorCode.NO_AGENTS_AVAILABLE
    assert "last failure: agent_disconnected" in info.value.message
    assert stale.active == 0
