"""Admission as a pipeline stage, through its public call: a ticket goes in, the rest of the
pipeline is a stand-in terminal, the answer's close settles what admission held.

State is read from the ports admission was given; refusals are read from the events the
stage emits. Waiting (the park timeout) runs in virtual time.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import math
import sys
from types import SimpleNamespace

import psutil
import pytest

from hivenet_router.auth.config import ModelQuota, Quota
from hivenet_router.auth.providers import Principal
from hivenet_router.clock import ManualClock, run_in_virtual_time
from hivenet_router.domain.agent import EngineSnapshot
from hivenet_router.domain.answer import Answer, Outcome, Whole
from hivenet_router.domain.errors import ApiError, ErrorCode
from hivenet_router.domain.request import Job, RequestFacts
from hivenet_router.observability.events import Event, Observers, Refused
from hivenet_router.pipeline.ticket import Ticket
from hivenet_router.policy.document import BUILT_IN, Policy, parse_policy
from hivenet_router.router.admission import Admission, Estimator
from hivenet_router.router.bodies import parse
from hivenet_router.router.rate import RequestRate
from hivenet_router.state.local import DailyCounter, LocalPool, RateCounter
from hivenet_router.state.ports import Ports

CHAT = b'{"model": "m", "messages": [{"role": "user", "content": "' + b"x" * 320 + b'"}]'
ROUTE = "/v1/chat/completions"
# The reference's way with undeclared output: no bound held, output counted as it streams.
UNBOUNDED = "default_max_tokens: 0\nrouting_policy: {strategy: least-loaded}\n"


class Recorder:
    def __init__(self) -> None:
        self.events: list[Event] = []

    def on_event(self, ticket: Ticket, event: Event) -> None:
        self.events.append(event)

    def on_agent(self, event: object) -> None:
        pass

    def refusals(self) -> list[str]:
        return [e.reason for e in self.events if isinstance(e, Refused)]


class Fleet:
    """An Admission with local ports, a recorder, and a way to send it requests."""

    def __init__(self, policy: str | None = None, clock: ManualClock | None = None) -> None:
        self.clock = clock or ManualClock()
        self.policy: Policy = (
            parse_policy(policy, "p.yaml", "p", require_models=False) if policy else BUILT_IN
        )
        self.ports = Ports(
            rates=RateCounter(self.clock),
            daily=DailyCounter(self.clock),
            input_rates=RateCounter(self.clock),
            output_rates=RateCounter(self.clock),
            occupancy=LocalPool(self.clock, alone_fits=True),
            shares=LocalPool(self.clock, alone_fits=False),
        )
        self.healthy: list[object] = []
        self.admission = Admission(
            self.clock,
            lambda model: self.healthy,  # type: ignore[arg-type,return-value]
            self.ports,
            park_timeout=0.05,
        )
        self.rate = RequestRate(self.ports.rates, lambda model: self.healthy)  # type: ignore[arg-type,return-value]
        self.recorder = Recorder()
        self._parsed: dict[tuple[str, bytes], RequestFacts] = {}
        self.answer_body = b'{"usage": {"prompt_tokens": 90, "completion_tokens": 10}}'

    def ticket(self, principal: Principal, body: bytes, route: str = ROUTE) -> Ticket:
        ticket = Ticket("rid", route, 0.0, Observers([self.recorder]))
        ticket.principal = principal
        ticket.policy = self.policy  # as the handlers resolve it, before the first stage
        ticket.facts = self._parsed.get((route, body)) or parse(route, body)
        self._parsed[(route, body)] = ticket.facts
        ticket.job = Job(route, ticket.facts.model, "llm", False, body, [])
        return ticket

    async def send(
        self, ticket: Ticket, *, stream: bytes | None = None, status: int = 200
    ) -> Answer:
        """Run the rate stage, then admission; the terminal answers whole (or with a first
        stream chunk)."""

        async def terminal(t: Ticket) -> Answer:
            if stream is not None:
                return Answer(status, [], Whole(), first=stream)
            return Answer(status, [], Whole(), body=self.answer_body)

        async def admission(t: Ticket) -> Answer:
            return await self.admission(t, terminal)

        return await self.rate(ticket, admission)

    async def request(self, principal: Principal, body: bytes, route: str = ROUTE) -> Answer:
        return await self.send(self.ticket(principal, body, route))

    def occupancy(self) -> tuple[int, int]:
        levels = {key: (tokens, n) for key, tokens, n in self.ports.occupancy.levels()}  # type: ignore[attr-defined]
        return levels.get("m", (0, 0))


def who(quota: Quota, share: float = 0.0, key: str = "k1") -> Principal:
    return Principal("t", key, "n", frozenset(), quota, share)


def test_the_estimator_learns_per_model_and_stays_clamped() -> None:
    estimator = Estimator()
    assert estimator.estimate("m", 320, 1) == 100 + 4
    for _ in range(50):
        estimator.learn("m", 1000, 1, 504)  # 0.5 tokens per byte
    assert estimator.ratio("m") == pytest.approx(0.5, rel=1e-3)
    assert estimator.ratio("other") == pytest.approx(1 / 3.2)
    for _ in range(50):
        estimator.learn("m", 10, 0, 10_000)  # absurd: clamped to 1 token per byte
    assert estimator.ratio("m") <= 1.0


async def test_request_rates_flat_and_per_model() -> None:
    fleet = Fleet()
    flat = who(Quota(requests_per_minute=2))
    for _ in range(2):
        await (await fleet.request(flat, CHAT + b"}")).close(Outcome.OK)
    refused = fleet.ticket(flat, CHAT + b"}")
    with pytest.raises(ApiError) as info:
        await fleet.send(refused)
    assert info.value.code is ErrorCode.RATE_LIMIT_EXCEEDED
    assert refused.headers_out["Retry-After"] == "30"  # 2 a minute: one refills in 30 s
    per_model = who(Quota(per_model={"m": ModelQuota(rpm_per_replica=1, tokens_per_day=0)}))
    await fleet.request(per_model, CHAT + b"}")  # no healthy replica: left to routing
    fleet.healthy = [SimpleNamespace(engine=None)] * 2
    ticket = fleet.ticket(per_model, CHAT + b"}")
    await fleet.send(ticket)
    assert ticket.headers_out["X-RateLimit-Remaining-Requests"] == "1"  # 1 x 2 replicas
    await fleet.request(per_model, CHAT + b"}")
    with pytest.raises(ApiError):
        await fleet.request(per_model, CHAT + b"}")
    unlisted = CHAT.replace(b'"m"', b'"other"') + b"}"
    with pytest.raises(ApiError, match="no quota declared for model other"):
        await fleet.request(per_model, unlisted)
    assert fleet.recorder.refusals() == ["b4_rpm"] * 3


async def test_b1_caps_and_the_daily_budget() -> None:
    fleet = Fleet("max_input_tokens: 50\nimages_max: 1\nrouting_policy: {strategy: least-loaded}\n")
    with pytest.raises(ApiError) as info:
        await fleet.request(who(Quota()), CHAT + b"}")
    assert info.value.code is ErrorCode.INPUT_TOO_LONG and "104 tokens" in info.value.message
    images = (
        b'{"model": "m", "messages": [{"role": "user", "content": ['
        b'{"type": "image_url", "image_url": {"url": "a"}},'
        b'{"type": "image_url", "image_url": {"url": "b"}}]}]}'
    )
    with pytest.raises(ApiError, match="2 images"):
        await fleet.request(who(Quota()), images)
    assert fleet.recorder.refusals() == ["b1", "b1"]

    budget = Fleet()
    quota = Quota(tokens_per_day=300)
    ticket = budget.ticket(who(quota), CHAT + b', "max_tokens": 100}')
    answer = await budget.send(ticket)
    assert ticket.headers_out["X-RateLimit-Remaining-Tokens"] == "96"  # 204 of 300
    refused = budget.ticket(who(quota), CHAT + b', "max_tokens": 100}')
    with pytest.raises(ApiError) as info:
        await budget.send(refused)
    assert info.value.code is ErrorCode.TOKEN_LIMIT_EXCEEDED
    assert budget.recorder.refusals() == ["daily"]
    # Found by a new user: the SDKs retried it at once, though nothing changes before the
    # budget's day ends (UTC midnight).
    wall = budget.clock.wall()
    assert refused.headers_out["Retry-After"] == str(math.ceil(86_400 - wall % 86_400))
    assert refused.headers_out["x-should-retry"] == "false"
    assert budget.ports.daily.used("t") == 204  # type: ignore[attr-defined]
    await answer.close(Outcome.OK)
    assert budget.ports.daily.used("t") == 100  # type: ignore[attr-defined]  # exact usage
    # count_tokens passes B1 and the budget; only the request rate applies.
    counted = budget.ticket(
        who(quota), CHAT + b', "max_tokens": 9999}', "/v1/messages/count_tokens"
    )
    await budget.send(counted)
    assert budget.ports.daily.used("t") == 100  # type: ignore[attr-defined]


async def test_completions_are_admitted_and_charged_like_chat() -> None:
    fleet = Fleet("max_input_tokens: 50\nrouting_policy: {strategy: least-loaded}\n")
    prompt = b'{"model": "m", "prompt": "' + b"x" * 320 + b'", "max_tokens": 64}'
    with pytest.raises(ApiError) as info:
        await fleet.request(who(Quota()), prompt, "/v1/completions")
    assert info.value.code is ErrorCode.INPUT_TOO_LONG
    small = b'{"model": "m", "prompt": "hello", "max_tokens": 64}'
    budget = who(Quota(tokens_per_day=100))
    answer = await fleet.request(budget, small, "/v1/completions")
    assert fleet.ports.daily.used("t") == 66  # type: ignore[attr-defined]  # 2 + 64
    with pytest.raises(ApiError) as refused:
        await fleet.request(budget, small, "/v1/completions")
    assert refused.value.code is ErrorCode.TOKEN_LIMIT_EXCEEDED
    fleet.answer_body = b'{"usage": {"prompt_tokens": 2, "completion_tokens": 64}}'
    await answer.close(Outcome.OK)


async def test_a_request_nobody_answered_is_refunded() -> None:
    fleet = Fleet()
    quota = Quota(tokens_per_day=1000)

    async def failing(ticket: Ticket) -> Answer:
        raise ApiError(ErrorCode.NO_AGENTS_AVAILABLE, "nobody")

    with pytest.raises(ApiError):
        await fleet.admission(fleet.ticket(who(quota), CHAT + b', "max_tokens": 100}'), failing)
    assert fleet.ports.daily.used("t") == 0  # type: ignore[attr-defined]
    fleet.answer_body = b'{"error": "engine refused"}'
    answer = await fleet.send(fleet.ticket(who(quota), CHAT + b', "max_tokens": 100}'), status=400)
    await answer.close(Outcome.OK)
    assert fleet.ports.daily.used("t") == 0  # type: ignore[attr-defined]  # an error answer


def test_occupancy_parks_then_refuses_and_is_released_once() -> None:
    clock = ManualClock()

    async def run() -> None:
        fleet = Fleet(
            "admit_budget_tokens: 1000\nmax_inflight: 2\n"
            "routing_policy: {strategy: least-loaded}\n",
            clock,
        )
        body = CHAT + b', "max_tokens": 700}'  # 804 tokens
        first = await fleet.request(who(Quota()), body)
        assert fleet.occupancy() == (804, 1)
        # The budget is floor(0.9 * 1000 * 1 replica) = 900: a second one parks, then gives up.
        ticket = fleet.ticket(who(Quota()), body)
        with pytest.raises(ApiError) as info:
            await fleet.send(ticket)
        assert info.value.code is ErrorCode.CONCURRENCY_LIMIT_EXCEEDED
        assert ticket.headers_out["Retry-After"] == "1"
        assert fleet.recorder.refusals() == ["b2"]
        # A parked request is admitted as soon as room frees.
        waiter = asyncio.create_task(fleet.request(who(Quota()), body))
        await asyncio.sleep(0.01)
        await first.close(Outcome.OK)
        await first.close(Outcome.OK)  # a second close releases nothing
        second = await waiter
        assert fleet.occupancy() == (804, 1)
        await second.close(Outcome.CLIENT_GONE)
        assert fleet.occupancy() == (0, 0)

    run_in_virtual_time(clock, run())


async def test_the_inflight_backstop() -> None:
    fleet = Fleet("max_inflight: 1\nrouting_policy: {strategy: least-loaded}\n")
    held = await fleet.request(who(Quota()), CHAT + b"}")
    with pytest.raises(ApiError):
        await fleet.request(who(Quota()), CHAT + b"}")
    await held.close(Outcome.BROKEN)
    await (await fleet.request(who(Quota()), CHAT + b"}")).close(Outcome.OK)


async def test_pressure_shedding_averages_the_pool() -> None:
    fleet = Fleet(
        "shed_if:\n  kv_cache_utilization: {gt: 0.8}\nrouting_policy: {strategy: least-loaded}\n"
    )

    def agent(kv: float | None) -> SimpleNamespace:
        return SimpleNamespace(engine=EngineSnapshot(kv_cache_utilization=kv))

    fleet.healthy = [agent(0.95), agent(0.5)]  # average 0.725: under the threshold
    await fleet.request(who(Quota()), CHAT + b"}")
    fleet.healthy += [agent(0.99), agent(None)]  # missing signals do not count
    with pytest.raises(ApiError) as info:
        await fleet.request(who(Quota()), CHAT + b"}")
    assert info.value.code is ErrorCode.CONCURRENCY_LIMIT_EXCEEDED
    assert "high load" in info.value.message and fleet.recorder.refusals() == ["b3"]


async def test_serverless_per_key_limits() -> None:
    fleet = Fleet(
        "mode: serverless\nadmit_budget_tokens: 10000\nrouting_policy: {strategy: least-loaded}\n"
    )
    body = CHAT + b', "max_tokens": 1000}'  # 1104 tokens
    # Occupancy share: 0.2 x 10000 x 1 replica = 2000 tokens in flight for this key.
    sharer = who(Quota(), share=0.2)
    held = await fleet.request(sharer, body)
    ticket = fleet.ticket(sharer, body)
    with pytest.raises(ApiError, match="occupancy share") as info:
        await fleet.send(ticket)
    assert info.value.code is ErrorCode.RATE_LIMIT_EXCEEDED
    assert ticket.headers_out["Retry-After"] == "1"
    await fleet.request(who(Quota(), 0.2, "other-key"), body)
    assert fleet.ports.shares.held("k1\x00m") == 1104  # type: ignore[attr-defined]
    await held.close(Outcome.OK)
    assert fleet.ports.shares.held("k1\x00m") == 0  # type: ignore[attr-defined]
    # Input tokens per minute: charged with the estimate before the request goes out.
    itpm = who(Quota(input_tokens_per_minute=150), key="k2")
    await fleet.request(itpm, body)  # 104 of 150
    with pytest.raises(ApiError, match="input token rate"):
        await fleet.request(itpm, body)
    # Output tokens per minute: charged after the answer; a drained bucket refuses the next.
    otpm = who(Quota(output_tokens_per_minute=100), key="k3")
    fleet.answer_body = b'{"usage": {"prompt_tokens": 104, "completion_tokens": 500}}'
    await (await fleet.request(otpm, body)).close(Outcome.OK)
    with pytest.raises(ApiError, match="output token rate"):
        await fleet.request(otpm, body)
    assert fleet.recorder.refusals() == ["b4_occupancy", "b4_itpm", "b4_otpm"]


async def test_per_key_token_rates_are_kept_per_model() -> None:
    fleet = Fleet(
        "mode: serverless\nadmit_budget_tokens: 10000\nrouting_policy: {strategy: least-loaded}\n"
    )
    key = who(Quota(input_tokens_per_minute=150))
    first = CHAT + b', "max_tokens": 1}'  # 104 input tokens
    other = CHAT.replace(b'"m"', b'"m2"') + b', "max_tokens": 1}'
    await fleet.request(key, first)
    with pytest.raises(ApiError, match="input token rate"):
        await fleet.request(key, first)
    # The same key on another model draws on a bucket of its own, as the reference keeps them.
    await fleet.request(key, other)


async def test_reserved_mode_ignores_per_key_limits() -> None:
    fleet = Fleet("admit_budget_tokens: 10000\nrouting_policy: {strategy: least-loaded}\n")
    strict = who(Quota(input_tokens_per_minute=1), share=0.01)
    await fleet.request(strict, CHAT + b', "max_tokens": 1000}')


async def test_undeclared_output_grows_with_the_stream_and_is_all_released() -> None:
    fleet = Fleet(UNBOUNDED + "mode: serverless\nadmit_budget_tokens: 10000\n")
    principal = who(Quota(), share=1.0)
    # No max_tokens: 104 tokens at first, then about one per streamed event.
    answer = await fleet.send(fleet.ticket(principal, CHAT + b"}"), stream=b"data: {}\n\n")
    assert fleet.occupancy() == (104, 1)
    answer.source = _Chunks([b"data: {}\n\n" * 30, b"data: {}\n\n" * 20])
    while await answer.next_chunk() is not None:
        pass
    assert fleet.occupancy() == (154, 1)
    assert fleet.ports.shares.held("k1\x00m") == 154  # type: ignore[attr-defined]
    await answer.close(Outcome.OK)
    assert fleet.occupancy() == (0, 0)
    # A declared max_tokens does not grow.
    declared = await fleet.send(
        fleet.ticket(principal, CHAT + b', "max_tokens": 5}'), stream=b"data: {}\n\n"
    )
    declared.source = _Chunks([b"data: {}\n\n" * 50])
    await declared.next_chunk()
    assert fleet.occupancy() == (109, 1)
    await declared.close(Outcome.OK)


async def test_a_stream_without_usage_is_charged_its_text_not_its_data_lines() -> None:
    fleet = Fleet(UNBOUNDED)
    budget = who(Quota(tokens_per_day=10_000))
    # No max_tokens, no include_usage: 104 tokens charged at admission; at the end the
    # input estimate (as the relay sets it) and the output counted from the text sent:
    # 50 events of 8 bytes are 100 tokens, whatever the number of data lines around them.
    answer = await fleet.send(fleet.ticket(budget, CHAT + b"}"), stream=b"data: {}\n\n")
    answer.input_estimate = 104
    assert fleet.ports.daily.used("t") == 104  # type: ignore[attr-defined]
    event = b'data: {"choices": [{"index": 0, "delta": {"content": "12345678"}}]}\n\n'
    answer.source = _Chunks([event * 29 + b"data: {}\n\n", event * 21 + b"data: [DONE]\n\n"])
    while await answer.next_chunk() is not None:
        pass
    await answer.close(Outcome.OK)
    assert answer.usage_estimated
    assert fleet.ports.daily.used("t") == 104 + 100  # type: ignore[attr-defined]
    # Reported usage wins.
    reported = await fleet.send(
        fleet.ticket(budget, CHAT + b"}"),
        stream=b'data: {"usage": {"prompt_tokens": 90, "completion_tokens": 7}}\n\n',
    )
    await reported.close(Outcome.OK)
    assert fleet.ports.daily.used("t") == 204 + 97  # type: ignore[attr-defined]
    assert not reported.usage_estimated
    declared = await fleet.send(
        fleet.ticket(budget, CHAT + b', "max_tokens": 5}'), stream=b"data: {}\n\n" * 40
    )
    declared.input_estimate = 104
    assert fleet.ports.daily.used("t") > 301  # type: ignore[attr-defined]
    await declared.close(Outcome.OK)
    # No usage and no text: the input estimate, not the declared worst case.
    assert fleet.ports.daily.used("t") == 301 + 104  # type: ignore[attr-defined]


async def test_occupancy_grows_per_event_and_the_daily_budget_takes_the_meter() -> None:
    fleet = Fleet(UNBOUNDED + "mode: serverless\nadmit_budget_tokens: 10000\n")
    principal = who(Quota(tokens_per_day=10_000), share=1.0)
    answer = await fleet.send(fleet.ticket(principal, CHAT + b"}"), stream=b"data: {}\n\n")
    answer.input_estimate = 104
    answer.source = _Chunks([b"data: {}\n\n" * 30, b"data: {}\n\n" * 20 + b"data: [DONE]\n\n"])
    while await answer.next_chunk() is not None:
        pass
    assert fleet.occupancy() == (154, 1)  # 104 at first, then a token per data line
    await answer.close(Outcome.OK)
    assert fleet.occupancy() == (0, 0)
    # Billed what the answer's meter says: the input estimate, and no text, no output.
    assert fleet.ports.daily.used("t") == 104  # type: ignore[attr-defined]


async def test_the_exact_input_a_stream_announces_replaces_the_estimate() -> None:
    fleet = Fleet("admit_budget_tokens: 10000\nrouting_policy: {strategy: least-loaded}\n")
    start = (
        b'event: message_start\ndata: {"type": "message_start", "message": '
        b'{"usage": {"input_tokens": 80, "output_tokens": 1}}}\n\n'
    )
    body = CHAT + b', "max_tokens": 10}'  # estimate 104 + 10
    answer = await fleet.send(fleet.ticket(who(Quota()), body, "/v1/messages"), stream=start)
    assert fleet.occupancy() == (90, 1)
    await answer.close(Outcome.OK)
    assert fleet.occupancy() == (0, 0)


class _Chunks:
    def __init__(self, chunks: list[bytes]) -> None:
        self._chunks = chunks

    async def read(self) -> bytes | None:
        return self._chunks.pop(0) if self._chunks else None

    def close(self, outcome: Outcome) -> None:
        pass


def _memory() -> tuple[int, int]:
    """(small Python objects alive, resident bytes once freed memory went back to the OS)."""
    gc.collect()
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
    return sys.getallocatedblocks(), psutil.Process().memory_info().rss


_LIBC = (
    ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6") if sys.platform == "linux" else None
)


async def test_idle_state_of_100000_keys_is_forgotten() -> None:
    """Every key and model ever seen leaves buckets behind; the sweep forgets the idle ones,
    and memory returns to where it was before the keys came: the count of live Python
    objects exactly, the process's resident memory within a few MiB (what the allocator
    keeps fragmented), where 100,000 keys took over 100 MiB."""
    fleet = Fleet(
        "mode: serverless\nadmit_budget_tokens: 100000000\n"
        "routing_policy: {strategy: least-loaded}\n"
    )
    fleet.recorder.on_event = lambda ticket, event: None  # type: ignore[method-assign]
    quota = Quota(
        requests_per_minute=10,
        tokens_per_day=10_000,
        input_tokens_per_minute=10_000,
        output_tokens_per_minute=10_000,
    )
    body = CHAT + b', "max_tokens": 10}'
    ports = fleet.ports

    async def wave(keys: range) -> None:
        for index in keys:
            principal = Principal(f"tenant-{index}", f"key-{index}", "n", frozenset(), quota, 0.5)
            await (await fleet.request(principal, body)).close(Outcome.OK)

    def held() -> int:
        counters = (ports.rates, ports.daily, ports.input_rates, ports.output_rates)
        pools = (ports.occupancy, ports.shares)
        return sum(len(port) for port in (*counters, *pools))  # type: ignore[arg-type]

    await wave(range(1000))  # warm up the interpreter's caches and free lists
    fleet.clock.advance(86_400)
    fleet.admission.sweep()
    blocks, resident = _memory()
    await wave(range(100_000))
    assert len(ports.rates) == 100_000 and len(ports.daily) == 100_000  # type: ignore[arg-type]
    assert len(ports.shares) == 100_000  # type: ignore[arg-type]
    grown_blocks, grown = _memory()
    # The state really exists: counted in live objects, which a long test run's heap (freed
    # memory it reuses without growing) cannot hide as it can the resident size.
    assert grown_blocks - blocks > 10 * 100_000, (blocks, grown_blocks, resident, grown)
    fleet.clock.advance(86_400)  # a day later: buckets refilled, yesterday's totals past
    fleet.admission.sweep()
    after_blocks, after = _memory()
    assert held() == 0
    assert after_blocks - blocks < 1000, (blocks, grown_blocks, after_blocks)
    assert after - resident < 8 << 20, (resident, grown, after)


async def test_embeddings_and_rerank_count_against_the_daily_budget() -> None:
    """Found by a new user: a key out of its daily budget kept embedding (456 tokens a
    request), counted by the audit record and the metrics but never by the budget."""
    budget = Fleet()
    budget.answer_body = b'{"data": [], "usage": {"prompt_tokens": 456, "total_tokens": 456}}'
    quota = Quota(tokens_per_day=1000)
    texts = b'{"model": "m", "input": ["' + b"word " * 300 + b'"]}'
    ticket = budget.ticket(who(quota), texts, "/v1/embeddings")
    assert ticket.facts is not None and ticket.facts.text_bytes == 1500
    answer = await budget.send(ticket)
    assert budget.ports.daily.used("t") == 469  # type: ignore[attr-defined]  # the estimate
    await answer.close(Outcome.OK)
    assert budget.ports.daily.used("t") == 456  # type: ignore[attr-defined]  # exact usage
    await (await budget.request(who(quota), texts, "/v1/embeddings")).close(Outcome.OK)
    with pytest.raises(ApiError) as info:
        await budget.request(who(quota), texts, "/v1/embeddings")
    assert info.value.code is ErrorCode.TOKEN_LIMIT_EXCEEDED
    assert "for the input" in info.value.message
    # A rerank in vLLM's shape reports its input as total_tokens.
    budget.answer_body = b'{"results": [], "usage": {"total_tokens": 9}}'
    rerank = b'{"model": "m", "query": "q", "documents": ["a", "b"]}'
    await (await budget.request(who(quota), rerank, "/v1/rerank")).close(Outcome.OK)
    assert budget.ports.daily.used("t") == 921  # type: ignore[attr-defined]
