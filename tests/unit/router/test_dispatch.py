"""Dispatch, the pipeline's terminal, through its public call: a ticket goes in, an answer
comes out, and closing the answer gives back what it held.

Each agent is a registry record whose connection is a real link over loopback; on the
other end a small handler answers as an engine would (a status and a body, optionally held
until the test lets it go).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest
import uvloop
from aiohttp import web

from hivenet_router.auth.providers import ANONYMOUS
from hivenet_router.clock import Clock, ManualClock, SystemClock, run_in_virtual_time
from hivenet_router.domain.agent import EngineSnapshot, Registration
from hivenet_router.domain.answer import Answer, Outcome
from hivenet_router.domain.classify import classify
from hivenet_router.domain.errors import ApiError, ErrorCode, error_body
from hivenet_router.domain.request import Job, RequestFacts
from hivenet_router.gateway.validator import AVOID
from hivenet_router.observability.events import Observers
from hivenet_router.pipeline.ticket import Ticket
from hivenet_router.policy.document import parse_policy
from hivenet_router.policy.store import PolicySet, PolicyStore
from hivenet_router.router.dispatch import LEAVE_POOL, Dispatcher
from hivenet_router.router.forwarding import DispatchLimits
from hivenet_router.router.providers import ProviderConfig, Providers
from hivenet_router.router.registry import AgentRecord, Registry
from hivenet_router.transport.link import INFERENCE_PROTOCOL, LinkClosed, Stream
from tests.linkpair import link_pair

ROUTE = "/v1/chat/completions"


class Engine:
    """Answers every request with `status`; `gate`, when set, holds answers until set."""

    def __init__(self, status: int = 200) -> None:
        self.status = status
        self.calls = 0
        self.gate: asyncio.Event | None = None
        self.opened = asyncio.Event()

    async def handle(self, stream: Stream) -> None:
        self.calls += 1
        self.opened.set()
        await stream.read_all(1 << 20)
        if self.gate is not None:
            await self.gate.wait()
        body = b'{"usage": {"prompt_tokens": 3, "completion_tokens": 2}}'
        if self.status == 404:  # as the agent classifies an engine's 404 on a route it lacks
            body = classify(404, b'{"detail": "Not Found"}')[2]
        elif self.status >= 500:
            body = error_body(ErrorCode.BACKEND_ERROR, "boom", "backend", self.status)
        elif self.status >= 400:
            body = error_body(ErrorCode.INVALID_PARAMETER, "bad", "backend", self.status)
        await stream.send_head(self.status, [("content-type", "application/json")], body, end=True)


class Fleet:
    def __init__(
        self,
        stack: contextlib.AsyncExitStack,
        policy: str,
        queue_depth: int,
        clock: Clock | None = None,
    ) -> None:
        self.stack = stack
        self.registry = Registry()
        self.store = PolicyStore()
        self.store.current = PolicySet(
            default=parse_policy(policy, "t.yaml", "t", require_models=False)
        )
        limits = DispatchLimits(
            queue_size=10,
            max_concurrent=10,
            enqueue_timeout=1.0,
            queue_depth=queue_depth,
            max_tries=3,
        )
        self.dispatcher = Dispatcher(self.registry, clock or ManualClock(), limits, self.store)
        self.engines: dict[str, Engine] = {}
        self.left: list[str] = []

    async def agent(
        self, peer: str, status: int = 200, region: str = "eu", capacity: int = 4
    ) -> AgentRecord:
        engine = self.engines[peer] = Engine(status)
        pair = await self.stack.enter_async_context(link_pair(INFERENCE_PROTOCOL, engine.handle))
        reg = Registration(
            peer_id=peer,
            model="m",
            capability="llm",
            engine="vllm",
            capacity=capacity,
            region=region,
        )
        record = AgentRecord(reg=reg, link=pair.client, last_heartbeat=0.0, registered_at=0.0)
        self.registry.upsert(record)
        return record

    def ticket(self, model: str = "m") -> Ticket:
        ticket = Ticket("rid", ROUTE, 0.0, Observers())
        ticket.facts = RequestFacts(ROUTE, model, "llm", False, None)
        ticket.job = Job(ROUTE, model, "llm", False, b"{}", [])
        ticket.deadline = asyncio.get_running_loop().time() + 5
        ticket.principal = ANONYMOUS  # the edge authenticated it
        ticket.policy = self.store.current.for_model(model)  # resolved before the stages
        ticket.put(LEAVE_POOL, lambda: self.left.append("left"))
        return ticket

    async def send(self) -> Answer:
        return await self.dispatcher(self.ticket())

    def held(self) -> tuple[int, int]:
        return self.dispatcher.pending.forwarding, sum(a.active for a in self.registry.all())


@contextlib.asynccontextmanager
async def fleet(
    policy: str = "routing_policy: {strategy: least-loaded}\n",
    queue_depth: int = 2,
    clock: Clock | None = None,
) -> AsyncIterator[Fleet]:
    async with contextlib.AsyncExitStack() as stack:
        yield Fleet(stack, policy, queue_depth, clock)


async def test_answers_hold_their_slots_until_closed() -> None:
    async with fleet() as f:
        a, b = await f.agent("a", capacity=4), await f.agent("b", capacity=2)
        answers = [await f.send() for _ in range(6)]
        assert (a.active, b.active) == (4, 2)  # least loaded first, all six held
        assert f.held() == (6, 6)
        for answer in answers:
            assert answer.status == 200 and answer.body is not None
            await answer.close(Outcome.OK)
        assert f.held() == (0, 0)
        assert (a.successes + b.successes, a.input_tokens + b.input_tokens) == (6, 18)


async def test_errors_for_missing_and_ineligible_agents() -> None:
    async with fleet() as f:
        with pytest.raises(ApiError) as info:
            await f.send()
        assert info.value.code is ErrorCode.MODEL_NOT_FOUND
        embedder = await f.agent("e")
        embedder.reg = Registration(
            peer_id="e", model="m", capability="embedding", engine="x", capacity=1
        )
        with pytest.raises(ApiError) as info:
            await f.send()
        # Only an embedding agent serves m: a chat request is the client's mistake, not a
        # passing state (found by a new user: the SDKs retried the 503 three times).
        assert info.value.code is ErrorCode.INVALID_PARAMETER and info.value.param == "model"
        assert "served for embedding requests, not llm" in info.value.message
        sick = await f.agent("b")
        sick.backend_healthy = False
        with pytest.raises(ApiError) as info:
            await f.send()
        assert info.value.code is ErrorCode.NO_AGENTS_AVAILABLE
        assert f.held() == (0, 0)


async def test_waiters_are_served_in_order_and_bounded() -> None:
    async with fleet(queue_depth=2) as f:
        await f.agent("a", capacity=1)
        first = await f.send()
        order: list[int] = []

        async def wait(i: int) -> Answer:
            answer = await f.send()
            order.append(i)
            return answer

        one = asyncio.create_task(wait(1))
        await asyncio.sleep(0.05)
        two = asyncio.create_task(wait(2))
        await asyncio.sleep(0.05)
        with pytest.raises(ApiError) as info:
            await f.send()  # the queue of two is full
        assert info.value.code is ErrorCode.NO_CAPACITY
        assert f.dispatcher.queued("m") == 2
        await first.close(Outcome.OK)
        await (await one).close(Outcome.OK)
        await (await two).close(Outcome.OK)
        assert order == [1, 2]
        assert f.held() == (0, 0) and f.dispatcher.queued("m") == 0


async def test_a_new_agent_wakes_waiters() -> None:
    async with fleet() as f:
        await f.agent("a", capacity=1)
        first = await f.send()
        waiter = asyncio.create_task(f.send())
        await asyncio.sleep(0.05)
        assert not waiter.done() and f.dispatcher.queued("m") == 1
        await f.agent("b")
        second = await waiter
        assert second.origin == "b"
        for answer in (first, second):
            await answer.close(Outcome.OK)


async def test_a_cancelled_waiter_leaves_nothing() -> None:
    async with fleet() as f:
        await f.agent("a", capacity=1)
        first = await f.send()
        waiter = asyncio.create_task(f.send())
        await asyncio.sleep(0.05)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert f.dispatcher.queued("m") == 0 and f.held() == (1, 1)
        await first.close(Outcome.CLIENT_GONE)
        assert f.held() == (0, 0)


class StaleLink:
    """A connection that looks open but fails the moment a stream is opened: one that died
    quietly, before its reader noticed (not reproducible on demand with a real socket)."""

    closed = False

    async def open(self, *args: object, **kwargs: object) -> None:
        self.closed = True
        raise LinkClosed("stale")


async def test_a_stale_connection_costs_no_try() -> None:
    async with fleet() as f:
        f.dispatcher.limits = DispatchLimits(10, 10, 1.0, queue_depth=0, max_tries=1)
        stale = await f.agent("stale")
        stale.link = StaleLink()  # type: ignore[assignment]
        with pytest.raises(ApiError) as info:
            await f.send()
        # Dropped without using the single try; reported as the last failure.
        assert info.value.code is ErrorCode.NO_AGENTS_AVAILABLE
        assert "last failure: agent_disconnected" in info.value.message
        assert f.held() == (0, 0)


TWO_STEPS = """\
routing_policy: {match: {region: eu}, strategy: least-loaded, max_tries: 2}
fallback_chain:
  - {name: us, match: {region: us}, strategy: least-loaded, max_tries: 1}
"""


@pytest.mark.parametrize(
    ("agents", "winner", "calls", "error"),
    [
        # The primary step answers.
        ({"eu1": ("eu", 200), "us1": ("us", 200)}, "eu1", {"eu1": 1, "us1": 0}, None),
        # A failing primary pool uses its two tries, then the fallback step answers.
        (
            {"eu1": ("eu", 500), "eu2": ("eu", 500), "us1": ("us", 200)},
            "us1",
            {"eu1": 1, "eu2": 1, "us1": 1},
            None,
        ),
        # One failing agent in the primary pool: the other one is tried within the step.
        (
            {"eu1": ("eu", 500), "eu2": ("eu", 200), "us1": ("us", 200)},
            "eu2",
            {"eu1": 1, "eu2": 1, "us1": 0},
            None,
        ),
        # No agent matches the primary step: straight to the fallback, no try used.
        ({"us1": ("us", 200)}, "us1", {"us1": 1}, None),
        # Every step exhausted.
        (
            {"eu1": ("eu", 500), "us1": ("us", 500)},
            None,
            {"eu1": 1, "us1": 1},
            ErrorCode.NO_AGENTS_AVAILABLE,
        ),
        # No agent in any step's pool.
        ({"ap1": ("ap", 200)}, None, {"ap1": 0}, ErrorCode.NO_AGENTS_AVAILABLE),
        # A request error stops the chain at once, and is the answer.
        ({"eu1": ("eu", 400), "us1": ("us", 200)}, "eu1", {"eu1": 1, "us1": 0}, None),
    ],
)
async def test_chain_progression(
    agents: dict[str, tuple[str, int]],
    winner: str | None,
    calls: dict[str, int],
    error: ErrorCode | None,
) -> None:
    async with fleet(TWO_STEPS, queue_depth=0) as f:
        for peer, (region, status) in agents.items():
            await f.agent(peer, status, region)
        if error is None:
            answer = await f.send()
            assert answer.origin == winner
            await answer.close(Outcome.OK)
        else:
            with pytest.raises(ApiError) as info:
                await f.send()
            assert info.value.code is error
        assert {peer: engine.calls for peer, engine in f.engines.items()} == calls
        assert f.held() == (0, 0)
        # A client's mistake is nobody's failure; an engine's 5xx is its agent's.
        failures = {a.peer_id: a.failures for a in f.registry.all()}
        assert failures == {
            peer: calls[peer] if status >= 500 else 0 for peer, (_, status) in agents.items()
        }


async def test_an_engine_without_the_route_is_a_404_for_the_client_and_no_ones_failure() -> None:
    """Found by a new user: a token count on an engine without that route was retried on
    every agent, counted as each one's failure, and opened the model's breakers."""
    async with fleet() as f:
        await f.agent("a", 404)
        await f.agent("b", 404)
        for _ in range(6):
            answer = await f.send()
            assert answer.status == 404 and b'"not_found"' in (answer.body or b"")
            await answer.close(Outcome.OK)
        assert sum(engine.calls for engine in f.engines.values()) == 6  # never retried
        assert all(a.failures == 0 and a.consecutive_failures == 0 for a in f.registry.all())
        assert f.held() == (0, 0)


async def test_a_reload_does_not_touch_requests_in_flight() -> None:
    async with fleet(TWO_STEPS, queue_depth=0) as f:
        await f.agent("eu1", 500, "eu")
        await f.agent("us1", 200, "us")
        gate = f.engines["eu1"].gate = asyncio.Event()
        in_flight = asyncio.create_task(f.send())
        await f.engines["eu1"].opened.wait()
        # The new policy knows only the EU pool; the request in flight keeps its US fallback.
        f.store.current = PolicySet(
            default=parse_policy(
                "routing_policy: {match: {region: eu}, strategy: least-loaded}\n",
                "n.yaml",
                "n",
                require_models=False,
            )
        )
        gate.set()
        answer = await in_flight
        assert answer.origin == "us1"
        await answer.close(Outcome.OK)
        f.engines["eu1"].gate = None
        with pytest.raises(ApiError):
            await f.send()  # new requests see the new policy: EU only, and EU fails


async def test_capacity_is_checked_before_the_gates() -> None:
    # A full agent is "at capacity" (worth waiting for), even when a gate would also
    # exclude it; with waiting disabled the answer is no_capacity, not no_agents_available.
    text = (
        "routing_policy: {strategy: least-loaded, exclude_if: {capacity_utilization: {gt: 0.9}}}\n"
    )
    async with fleet(text, queue_depth=0) as f:
        await f.agent("a", capacity=1)
        held = await f.send()
        with pytest.raises(ApiError) as info:
            await f.send()
        assert info.value.code is ErrorCode.NO_CAPACITY
        await held.close(Outcome.OK)


async def test_a_busy_agent_is_waited_for_while_the_gates_keep_a_free_one_out() -> None:
    text = (
        "routing_policy: {strategy: least-loaded, exclude_if: {kv_cache_utilization: {gt: 0.9}}}\n"
    )
    async with fleet(text, queue_depth=4) as f:
        await f.agent("busy", capacity=1)
        hot = await f.agent("hot", capacity=1)
        hot.engine = EngineSnapshot(kv_cache_utilization=0.95)  # gated out, slot free
        held = await f.send()
        assert held.origin == "busy"
        waiters = [asyncio.create_task(f.send()) for _ in range(3)]
        cpu = time.process_time()
        await asyncio.sleep(0.3)
        # They wait for the busy agent rather than fail, and do not wake each other in a
        # circle meanwhile (each would pass the wake-up of the free slot on to the next).
        assert time.process_time() - cpu < 0.15
        assert not any(w.done() for w in waiters) and f.dispatcher.queued("m") == 3
        await held.close(Outcome.OK)
        for waiter in waiters:
            answer = await asyncio.wait_for(waiter, 2)
            assert answer.origin == "busy"
            await answer.close(Outcome.OK)
        assert f.held() == (0, 0) and f.dispatcher.queued("m") == 0


def test_waiters_look_again_when_an_open_breaker_lets_a_probe_through() -> None:
    # The only free agent's breaker is open and the other agent is busy on a long answer:
    # when the breaker turns half-open no slot frees, yet the waiter must be woken then to
    # probe it, not sleep until its deadline.
    clock = ManualClock()
    policy = (
        "routing_policy: {strategy: least-loaded}\n"
        "circuit_breaker: {consecutive_failures: 1, open_seconds: 2, half_open_probes: 1}\n"
    )

    async def main() -> None:
        async with fleet(policy, clock=clock) as f:
            await f.agent("sick", status=500, capacity=1)
            opened = clock.monotonic()  # no later than the breaker's opening
            with pytest.raises(ApiError):
                await f.send()  # its failure opens its breaker
            await f.agent("busy", capacity=1)
            held = await f.send()
            assert held.origin == "busy"
            f.engines["sick"].status = 200  # recovered; its breaker cannot know yet
            waiter = asyncio.create_task(f.send())
            await asyncio.sleep(0.5)
            assert not waiter.done() and f.dispatcher.queued("m") == 1
            answer = await asyncio.wait_for(waiter, 3)  # its deadline is 5 s away
            assert answer.origin == "sick" and 2 <= clock.monotonic() - opened < 3
            await answer.close(Outcome.OK)
            await held.close(Outcome.OK)
            assert f.held() == (0, 0) and f.dispatcher.queued("m") == 0

    run_in_virtual_time(clock, main())


def test_on_uvloop_in_real_time_every_waiter_gets_the_recovered_agent() -> None:
    # uvloop counts timers in whole milliseconds: the wake-up at the end of the open period
    # must neither come too early for the breaker nor trip over a timer set again in the
    # same turn by the waiters it woke.
    policy = (
        "routing_policy: {strategy: least-loaded}\n"
        "circuit_breaker: {consecutive_failures: 1, open_seconds: 0.3, half_open_probes: 1}\n"
    )

    async def main() -> None:
        async with fleet(policy, queue_depth=4, clock=SystemClock()) as f:
            await f.agent("sick", status=500, capacity=1)
            opened = time.monotonic()  # no later than the breaker's opening
            with pytest.raises(ApiError):
                await f.send()
            await f.agent("busy", capacity=1)
            held = await f.send()
            f.engines["sick"].status = 200
            waiters = [asyncio.create_task(f.send()) for _ in range(3)]
            served = []
            for next_answer in asyncio.as_completed(waiters, timeout=3):
                answer = await next_answer
                served.append(answer.origin)
                await answer.close(Outcome.OK)  # the probe's success closes the breaker
            assert served == ["sick"] * 3 and time.monotonic() - opened >= 0.3
            await held.close(Outcome.OK)
            assert f.held() == (0, 0) and f.dispatcher.queued("m") == 0

    uvloop.run(main())


async def test_each_consistent_hash_step_keys_on_its_own_header() -> None:
    text = (
        "routing_policy:\n  strategy: consistent-hash\n  match: {region: us}\n"
        "  hash: {key: session, header: x-shard}\n"
        "fallback_chain:\n  - strategy: consistent-hash\n"
        "    hash: {key: session, header: x-conversation}\n"
    )
    async with fleet(text) as f:
        for n in range(4):
            await f.agent(f"eu{n}", capacity=10)  # nobody in us: the fallback step serves
        chosen = set()
        for n in range(8):
            ticket = f.ticket()
            ticket.job = Job(
                ROUTE, "m", "llm", False, b"{}", [("x-shard", str(n)), ("x-conversation", "c1")]
            )
            answer = await f.dispatcher(ticket)
            chosen.add(answer.origin)
            await answer.close(Outcome.OK)
        assert len(chosen) == 1  # one conversation, one agent, whatever the shard header


async def test_provider_fallback_gives_back_local_reservations_first() -> None:
    calls: list[str] = []

    async def provider(request: web.Request) -> web.Response:
        calls.append(f"forward with {len(f.left)} left")
        return web.json_response({"usage": {"prompt_tokens": 1, "completion_tokens": 1}})

    app = web.Application()
    app.router.add_post(ROUTE, provider)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        text = (
            "routing_policy: {strategy: least-loaded}\n"
            "fallback_provider: {engine: openai, model: x}\n"
        )
        async with fleet(text, queue_depth=0) as f:
            f.dispatcher.providers = Providers({"openai": ProviderConfig("openai", url, "sk")})
            await f.agent("a", 500)
            ticket = f.ticket()
            answer = await f.dispatcher(ticket)
            assert answer.origin == "openai" and ticket.provider
            assert calls == ["forward with 1 left"]  # the pool was left before forwarding
            await answer.close(Outcome.OK)
            assert f.held() == (0, 0)
            await f.dispatcher.providers.close()
    finally:
        await runner.cleanup()


async def test_a_body_too_large_for_the_agent_is_a_413_not_a_retry() -> None:
    async with fleet() as f:
        await f.agent("a1")
        await f.agent("a2")
        ticket = f.ticket()
        ticket.job = Job(ROUTE, "m", "llm", False, b"x" * ((1 << 20) + 1), [])  # past read_all
        with pytest.raises(ApiError) as info:
            await f.dispatcher(ticket)
        assert info.value.code is ErrorCode.REQUEST_TOO_LARGE and info.value.status == 413
        assert sorted(e.calls for e in f.engines.values()) == [0, 1]  # no second agent tried
        assert f.held() == (0, 0)


async def test_a_woken_request_that_cannot_use_the_freed_slot_passes_the_wake_up_on() -> None:
    async with fleet(queue_depth=4) as f:
        x = await f.agent("x", capacity=1)
        y = await f.agent("y", capacity=1)
        on_y, on_x = f.ticket(), f.ticket()
        on_y.put(AVOID, frozenset({"x"}))
        on_x.put(AVOID, frozenset({"y"}))
        first = await f.dispatcher(on_y)
        second = await f.dispatcher(on_x)
        only_y = f.ticket()
        only_y.put(AVOID, frozenset({"x"}))
        a = asyncio.create_task(f.dispatcher(only_y))  # first in line, can only use y
        await asyncio.sleep(0.05)
        b = asyncio.create_task(f.dispatcher(f.ticket()))  # second, can use either
        await asyncio.sleep(0.05)
        y.draining = True
        await second.close(Outcome.OK)  # x frees and wakes a, which cannot use it
        with pytest.raises(ApiError):
            await asyncio.wait_for(a, 1)
        answer = await asyncio.wait_for(b, 1)  # b was woken in turn and took x
        assert x.held == 1
        await answer.close(Outcome.OK)
        await first.close(Outcome.OK)
        assert f.held() == (0, 0)


async def test_a_freed_slot_reaches_a_waiter_behind_two_that_cannot_use_it() -> None:
    async with fleet(queue_depth=8) as f:
        x = await f.agent("x", capacity=1)
        await f.agent("y", capacity=1)
        held = [await f.send(), await f.send()]  # x and y busy
        on_x = next(answer for answer in held if answer.origin == "x")

        def send(avoid: frozenset[str]) -> asyncio.Task[Answer]:
            ticket = f.ticket()
            ticket.put(AVOID, avoid)
            return asyncio.create_task(f.dispatcher(ticket))

        blocked = []
        for _ in range(2):  # first in line, but they cannot use x
            blocked.append(send(frozenset({"x"})))
            await asyncio.sleep(0.02)
        last = send(frozenset())
        await asyncio.sleep(0.02)
        assert f.dispatcher.queued("m") == 3
        await on_x.close(Outcome.OK)
        answer = await asyncio.wait_for(last, 2)  # not left asleep beside an idle x
        assert answer.origin == "x" and x.active == 1
        assert f.dispatcher.queued("m") == 2
        for task in blocked:
            task.cancel()
        await asyncio.gather(*blocked, return_exceptions=True)
        await answer.close(Outcome.OK)
        for other in held:
            if other is not on_x:
                await other.close(Outcome.OK)
        assert f.held() == (0, 0) and f.dispatcher.queued("m") == 0


async def test_a_release_that_frees_two_slots_wakes_two_waiters() -> None:
    async with fleet(queue_depth=8) as f:
        x = await f.agent("x", capacity=2)
        x.slot_limit = 1  # an adaptive limit the policy no longer has: lifted at settle
        first = await f.send()
        waiters = []
        for _ in range(2):
            waiters.append(asyncio.create_task(f.send()))
            await asyncio.sleep(0.02)
        assert f.dispatcher.queued("m") == 2 and x.limit == 1
        await first.close(Outcome.OK)  # the limit goes back to 2 and both slots are free
        answers = [await asyncio.wait_for(w, 1) for w in waiters]  # not one at the next beat
        assert x.active == 2 and f.dispatcher.queued("m") == 0
        for answer in answers:
            await answer.close(Outcome.OK)
        assert f.held() == (0, 0)


async def test_a_deadline_while_the_provider_answers_says_so() -> None:
    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(10)
        return web.json_response({})

    app = web.Application()
    app.router.add_post(ROUTE, slow)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    policy = (
        "routing_policy: {strategy: least-loaded}\nfallback_provider: {engine: openai, model: x}\n"
    )
    try:
        async with fleet(policy, queue_depth=0) as f:
            f.dispatcher.providers = Providers({"openai": ProviderConfig("openai", url, "sk")})
            await f.agent("a", 500)
            ticket = f.ticket()
            ticket.deadline = asyncio.get_running_loop().time() + 0.5
            with pytest.raises(ApiError) as info:
                await f.dispatcher(ticket)
            assert info.value.code is ErrorCode.REQUEST_TIMEOUT
            assert "provider" in info.value.message
            assert f.held() == (0, 0)
            await f.dispatcher.providers.close()
    finally:
        await runner.cleanup()
