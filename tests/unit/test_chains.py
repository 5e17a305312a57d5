"""Chain progression, tables of cases, over stand-in agent connections."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hivenet_router.clock import ManualClock
from hivenet_router.domain.agent import EngineSnapshot, Registration
from hivenet_router.domain.errors import ApiError, ErrorCode, error_body
from hivenet_router.policy.document import parse_policy
from hivenet_router.policy.store import PolicySet, PolicyStore
from hivenet_router.router.dispatch import Dispatcher, DispatchLimits, Job, Progress
from hivenet_router.router.history import smooth_rtt
from hivenet_router.router.metrics import RouterMetrics
from hivenet_router.router.registry import AgentRecord, Registry
from hivenet_router.transport.link import Head

JOB = Job("/v1/chat/completions", "m", "llm", False, b"{}", [])


@dataclass
class FakeStream:
    status: int
    body: bytes
    finished: bool = False

    async def response_head(self) -> Head:
        return Head("", "", "", self.status, [("content-type", "application/json")])

    async def read_all(self, limit: int) -> bytes:
        self.finished = True
        return self.body

    async def read(self) -> bytes | None:
        return None

    def reset(self, error: object = None) -> None:
        self.finished = True


@dataclass
class FakeLink:
    """Answers every request with `status`; `gate` holds requests until it is set."""

    status: int = 200
    closed: bool = False
    calls: int = 0
    gate: asyncio.Event | None = None
    opened: asyncio.Event = field(default_factory=asyncio.Event)

    async def open(self, *args: object) -> FakeStream:
        self.calls += 1
        self.opened.set()
        if self.gate is not None:
            await self.gate.wait()
        if self.status >= 500:
            return FakeStream(self.status, error_body(ErrorCode.BACKEND_ERROR, "boom"))
        if self.status >= 400:
            return FakeStream(self.status, error_body(ErrorCode.INVALID_PARAMETER, "bad"))
        return FakeStream(200, b'{"ok": true}')


def fleet(
    text: str, agents: dict[str, tuple[str, int]]
) -> tuple[Dispatcher, dict[str, FakeLink], PolicyStore]:
    """`agents`: peer -> (region, status its engine answers)."""
    metrics = RouterMetrics()
    registry = Registry(metrics)
    store = PolicyStore()
    store.current = PolicySet(default=parse_policy(text, "t.yaml", "t", require_models=False))
    limits = DispatchLimits(
        queue_size=10, max_concurrent=10, enqueue_timeout=1.0, queue_depth=0, max_tries=3
    )
    dispatcher = Dispatcher(registry, metrics, ManualClock(), limits, store)
    links = {}
    for peer, (region, status) in agents.items():
        reg = Registration(
            peer_id=peer, model="m", capability="llm", engine="vllm", capacity=4, region=region
        )
        link = links[peer] = FakeLink(status)
        registry.upsert(
            AgentRecord(
                reg=reg,
                link=link,
                session_digest=b"",  # type: ignore[arg-type]
                last_heartbeat=0.0,
                registered_at=0.0,
                meters=metrics.agent_meters(peer, "m"),
            )
        )
    return dispatcher, links, store


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
        # A request error stops the chain at once.
        ({"eu1": ("eu", 400), "us1": ("us", 200)}, "eu1", {"eu1": 1, "us1": 0}, None),
    ],
)
async def test_chain_progression(
    agents: dict[str, tuple[str, int]],
    winner: str | None,
    calls: dict[str, int],
    error: ErrorCode | None,
) -> None:
    dispatcher, links, _ = fleet(TWO_STEPS, agents)
    if error is None:
        exchange = await dispatcher._route(JOB, Progress(), dispatcher.policies.current.default)
        assert exchange.agent is not None and exchange.agent.peer_id == winner
        dispatcher._release(exchange.agent)
    else:
        with pytest.raises(ApiError) as info:
            await dispatcher._route(JOB, Progress(), dispatcher.policies.current.default)
        assert info.value.code is error
    assert {peer: link.calls for peer, link in links.items()} == calls
    assert all(a.active == 0 for a in dispatcher.registry.all())


@pytest.mark.parametrize(
    ("snapshot", "excluded"),
    [
        (None, False),  # missing signal: the gate passes
        (EngineSnapshot(kv_cache_utilization=0.5), False),
        (EngineSnapshot(kv_cache_utilization=0.95), True),
        (EngineSnapshot(waiting_requests=3.0), False),  # another signal: still missing here
    ],
)
async def test_gates_in_the_evaluator(snapshot: EngineSnapshot | None, excluded: bool) -> None:
    text = (
        "routing_policy: {strategy: least-loaded, exclude_if: {kv_cache_utilization: {gt: 0.9}}}\n"
    )
    dispatcher, links, _ = fleet(text, {"a": ("eu", 200)})
    record = dispatcher.registry.get("a")
    assert record is not None
    record.engine = snapshot
    if excluded:
        with pytest.raises(ApiError) as info:
            await dispatcher._route(JOB, Progress(), dispatcher.policies.current.default)
        assert info.value.code is ErrorCode.NO_AGENTS_AVAILABLE
        assert links["a"].calls == 0
    else:
        exchange = await dispatcher._route(JOB, Progress(), dispatcher.policies.current.default)
        assert exchange.agent is record


async def test_a_reload_does_not_touch_sessions_in_flight() -> None:
    dispatcher, links, store = fleet(TWO_STEPS, {"eu1": ("eu", 500), "us1": ("us", 200)})
    gate = links["eu1"].gate = asyncio.Event()
    deadline = asyncio.get_running_loop().time() + 5

    async def one() -> str:
        async with dispatcher.exchange(JOB, Progress(), deadline) as exchange:
            exchange.ok = True
            assert exchange.agent is not None
            return exchange.agent.peer_id

    in_flight = asyncio.create_task(one())
    await links["eu1"].opened.wait()
    # The new policy knows only the EU pool; the session in flight keeps its US fallback.
    store.current = PolicySet(
        default=parse_policy(
            "routing_policy: {match: {region: eu}, strategy: least-loaded}\n",
            "n.yaml",
            "n",
            require_models=False,
        )
    )
    gate.set()
    assert await in_flight == "us1"
    links["eu1"].gate = None
    with pytest.raises(ApiError):
        await one()  # new sessions see the new policy: EU only, and EU fails


@given(st.lists(st.floats(min_value=0.01, max_value=10_000), min_size=1, max_size=50))
def test_srtt_stays_within_the_samples(samples: list[float]) -> None:
    srtt: float | None = None
    rttvar: float | None = None
    for sample in samples:
        srtt, rttvar = smooth_rtt(srtt, rttvar, sample)
        assert rttvar >= 0
    assert srtt is not None
    assert min(samples) - 1e-6 <= srtt <= max(samples) + 1e-6


@given(st.floats(min_value=0.1, max_value=1000))
def test_steady_samples_converge(sample: float) -> None:
    srtt, rttvar = smooth_rtt(None, None, sample)
    for _ in range(200):
        srtt, rttvar = smooth_rtt(srtt, rttvar, sample)
    assert srtt == pytest.approx(sample)
    assert rttvar < sample * 1e-6


async def test_capacity_is_checked_before_the_gates() -> None:
    # A full agent is "at capacity" (worth waiting for), even when a gate would also
    # exclude it; with waiting disabled the answer is no_capacity, not no_agents_available.
    text = (
        "routing_policy: {strategy: least-loaded, exclude_if: {capacity_utilization: {gt: 0.9}}}\n"
    )
    dispatcher, _, _ = fleet(text, {"a": ("eu", 200)})
    record = dispatcher.registry.get("a")
    assert record is not None
    record.active = record.capacity
    with pytest.raises(ApiError) as info:
        await dispatcher._route(JOB, Progress(), dispatcher.policies.current.default)
    assert info.value.code is ErrorCode.NO_CAPACITY
    record.active = 0


async def test_provider_fallback_gives_back_local_reservations_first() -> None:
    from hivenet_router.router.providers import ProviderAnswer

    events: list[str] = []

    class FakeProviders:
        def supports(self, name: str, route: str) -> bool:
            return True

        async def forward(self, *args: object) -> ProviderAnswer:
            events.append("forward")
            return ProviderAnswer(200, [], b"{}", None, None)

    text = (
        "routing_policy: {strategy: least-loaded}\nfallback_provider: {engine: openai, model: x}\n"
    )
    dispatcher, _, _ = fleet(text, {"a": ("eu", 500)})
    dispatcher.providers = FakeProviders()  # type: ignore[assignment]
    job = Job(
        "/v1/chat/completions", "m", "llm", False, b"{}", [], lambda: events.append("released")
    )
    deadline = asyncio.get_running_loop().time() + 5
    async with dispatcher.exchange(job, Progress(), deadline) as exchange:
        assert exchange.provider == "openai" and exchange.agent is None
        exchange.ok = True
    assert events == ["released", "forward"]
