from __future__ import annotations

import asyncio
import gc
import tracemalloc
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hivenet_router.auth.config import ModelQuota, Quota
from hivenet_router.auth.providers import Principal
from hivenet_router.clock import ManualClock
from hivenet_router.domain.agent import EngineSnapshot
from hivenet_router.domain.errors import ApiError, ErrorCode
from hivenet_router.policy.document import BUILT_IN, parse_policy
from hivenet_router.router.admission import (
    Admission,
    DailyTokens,
    Estimator,
    RequestRates,
    TokenBucket,
)
from hivenet_router.router.bodies import parse
from hivenet_router.router.usage import Usage


def test_flat_rate_refills_continuously() -> None:
    clock = ManualClock()
    rates = RequestRates(clock)
    quota = Quota(requests_per_minute=2)
    assert rates.admit("t", quota, "m", 1).ok
    assert rates.admit("t", quota, "m", 1).ok
    third = rates.admit("t", quota, "m", 1)
    assert not third.ok and third.remaining == 0
    clock.advance(30)  # half a minute refills one request
    assert rates.admit("t", quota, "other-model", 1).ok  # flat: shared across models
    assert rates.admit("someone-else", quota, "m", 1).ok  # per tenant


def test_per_model_rates_scale_with_replicas_and_are_strict() -> None:
    clock = ManualClock()
    rates = RequestRates(clock)
    quota = Quota(per_model={"m": ModelQuota(rpm_per_replica=1, tokens_per_day=0)})
    assert rates.admit("t", quota, "m", 2).ok
    assert rates.admit("t", quota, "m", 2).ok
    assert not rates.admit("t", quota, "m", 2).ok
    assert rates.admit("t", quota, "m", 0).ok  # no healthy replica: left to routing
    refused = rates.admit("t", quota, "unlisted", 1)
    assert not refused.ok and "no quota declared for model unlisted" in refused.message


def test_burst_window() -> None:
    clock = ManualClock()
    rates = RequestRates(clock, burst_seconds=6)
    quota = Quota(requests_per_minute=60)  # burst of 6
    assert all(rates.admit("t", quota, "m", 1).ok for _ in range(6))
    assert not rates.admit("t", quota, "m", 1).ok


@given(
    capacity=st.integers(min_value=1, max_value=1000),
    steps=st.lists(
        st.tuples(st.floats(min_value=0, max_value=120), st.integers(min_value=1, max_value=50)),
        max_size=40,
    ),
)
def test_bucket_never_exceeds_its_capacity_or_goes_negative(
    capacity: int, steps: list[tuple[float, int]]
) -> None:
    bucket = TokenBucket(capacity, capacity / 60, 0.0)
    now = 0.0
    for wait, amount in steps:
        now += wait
        before = min(capacity, bucket.level + wait * bucket.per_second)
        took = bucket.take(now, amount)
        assert 0 <= bucket.level <= capacity
        assert took == (before >= amount)


def test_daily_budget_charges_trues_up_and_resets_at_utc_midnight() -> None:
    clock = ManualClock(wall_start=1_700_006_400.0)  # 2023-11-15 00:00 UTC
    daily = DailyTokens(clock)
    assert daily.charge("t", 600, 1000).remaining == 400
    refused = daily.charge("t", 500, 1000)
    assert not refused.ok and refused.remaining == 400
    daily.adjust("t", -300)  # the answer used less than the worst case
    assert daily.charge("t", 500, 1000).ok
    clock.advance(86400)
    assert daily.used("t") == 0 and daily.charge("t", 1000, 1000).ok
    assert daily.charge("u", 10**9, 0).ok  # 0: unlimited


def test_estimator_learns_per_model_and_stays_clamped() -> None:
    estimator = Estimator()
    assert estimator.estimate("m", 320, 1) == 100 + 4
    for _ in range(50):
        estimator.learn("m", 1000, 1, 504)  # 0.5 tokens per byte
    assert estimator.ratio("m") == pytest.approx(0.5, rel=1e-3)
    assert estimator.ratio("other") == pytest.approx(1 / 3.2)
    for _ in range(50):
        estimator.learn("m", 10, 0, 10_000)  # absurd: clamped to 1 token per byte
    assert estimator.ratio("m") <= 1.0


def who(quota: Quota, share: float = 0.0, key: str = "k1") -> Principal:
    return Principal("t", key, "n", frozenset(), quota, share)


def _admission(policy_text: str | None = None) -> Admission:
    policy = (
        parse_policy(policy_text, "p.yaml", "p", require_models=False) if policy_text else BUILT_IN
    )
    return Admission(ManualClock(), lambda model: policy, lambda model: [], park_timeout=0.05)


CHAT = b'{"model": "m", "messages": [{"role": "user", "content": "' + b"x" * 320 + b'"}]'


async def test_b1_caps_and_daily_budget_through_admission() -> None:
    admission = _admission(
        "max_input_tokens: 50\nimages_max: 1\nrouting_policy: {strategy: least-loaded}\n"
    )
    headers: dict[str, str] = {}
    with pytest.raises(ApiError) as info:
        await admission.admit(who(Quota()), parse("/v1/chat/completions", CHAT + b"}"), headers)
    assert info.value.code is ErrorCode.INPUT_TOO_LONG and "104 tokens" in info.value.message
    images = (
        b'{"model": "m", "messages": [{"role": "user", "content": ['
        b'{"type": "image_url", "image_url": {"url": "a"}},'
        b'{"type": "image_url", "image_url": {"url": "b"}}]}]}'
    )
    with pytest.raises(ApiError, match="2 images"):
        await admission.admit(who(Quota()), parse("/v1/chat/completions", images), headers)

    budget = _admission()
    quota = Quota(tokens_per_day=300)
    facts = parse("/v1/chat/completions", CHAT + b', "max_tokens": 100}')
    admitted = await budget.admit(who(quota), facts, headers)
    assert admitted is not None and admitted.charged == 204
    assert headers["X-RateLimit-Remaining-Tokens"] == "96"
    with pytest.raises(ApiError) as info:
        await budget.admit(who(quota), facts, headers)
    assert info.value.code is ErrorCode.TOKEN_LIMIT_EXCEEDED
    budget.settle(admitted, Usage(input_tokens=90, output_tokens=10), answered=True)
    assert budget.daily.used("t") == 100  # exact usage replaced the worst case
    # count_tokens and embeddings pass B1 and the budget; only the request rate applies.
    assert (
        await budget.admit(
            who(quota), parse("/v1/messages/count_tokens", CHAT + b', "max_tokens": 9999}'), headers
        )
        is None
    )


async def test_an_unanswered_request_is_refunded() -> None:
    admission = _admission()
    quota = Quota(tokens_per_day=1000)
    facts = parse("/v1/chat/completions", CHAT + b', "max_tokens": 100}')
    admitted = await admission.admit(who(quota), facts, {})
    assert admitted is not None
    admission.settle(admitted, None, answered=False)
    assert admission.daily.used("t") == 0


async def test_occupancy_parks_then_refuses_and_releases_exactly_once() -> None:
    admission = _admission(
        "admit_budget_tokens: 1000\nmax_inflight: 2\nrouting_policy: {strategy: least-loaded}\n"
    )
    facts = parse("/v1/chat/completions", CHAT + b', "max_tokens": 700}')  # 804 tokens
    headers: dict[str, str] = {}
    first = await admission.admit(who(Quota()), facts, headers)
    assert first is not None and first.footprint == 804
    # The budget is floor(0.9 * 1000 * 1 replica) = 900: a second one parks, then gives up.
    with pytest.raises(ApiError) as info:
        await admission.admit(who(Quota()), facts, headers)
    assert info.value.code is ErrorCode.CONCURRENCY_LIMIT_EXCEEDED
    assert headers["Retry-After"] == "1"
    pool = admission.pools["m"]
    assert (pool.tokens, pool.inflight) == (804, 1)
    # A parked request is admitted as soon as room frees.
    waiter = asyncio.create_task(admission.admit(who(Quota()), facts, {}))
    await asyncio.sleep(0.01)
    admission.settle(first, None, answered=True)
    admission.settle(first, None, answered=True)  # a second settle releases nothing
    second = await waiter
    assert second is not None and (pool.tokens, pool.inflight) == (804, 1)
    admission.settle(second, None, answered=True)
    assert (pool.tokens, pool.inflight) == (0, 0)


async def test_the_inflight_backstop() -> None:
    admission = _admission("max_inflight: 1\nrouting_policy: {strategy: least-loaded}\n")
    facts = parse("/v1/chat/completions", CHAT + b"}")
    held = await admission.admit(who(Quota()), facts, {})
    with pytest.raises(ApiError):
        await admission.admit(who(Quota()), facts, {})
    assert held is not None
    admission.settle(held, None, answered=True)
    assert await admission.admit(who(Quota()), facts, {}) is not None


async def test_pressure_shedding_averages_the_pool() -> None:
    policy = parse_policy(
        "shed_if:\n  kv_cache_utilization: {gt: 0.8}\nrouting_policy: {strategy: least-loaded}\n",
        "p",
        "p",
        require_models=False,
    )

    def agent(kv: float | None) -> SimpleNamespace:
        return SimpleNamespace(engine=EngineSnapshot(kv_cache_utilization=kv))

    pool = [agent(0.95), agent(0.5)]  # average 0.725: under the threshold
    admission = Admission(ManualClock(), lambda m: policy, lambda m: pool)  # type: ignore[arg-type,return-value]
    facts = parse("/v1/chat/completions", CHAT + b"}")
    assert await admission.admit(who(Quota()), facts, {}) is not None
    pool.append(agent(0.99))
    pool.append(agent(None))  # missing signals do not count
    with pytest.raises(ApiError) as info:
        await admission.admit(who(Quota()), facts, {})
    assert info.value.code is ErrorCode.CONCURRENCY_LIMIT_EXCEEDED
    assert "high load" in info.value.message


async def test_serverless_per_key_limits() -> None:
    admission = _admission(
        "mode: serverless\nadmit_budget_tokens: 10000\nrouting_policy: {strategy: least-loaded}\n"
    )
    facts = parse("/v1/chat/completions", CHAT + b', "max_tokens": 1000}')  # 1104 tokens
    # Occupancy share: 0.2 x 10000 x 1 replica = 2000 tokens in flight for this key.
    sharer = who(Quota(), share=0.2)
    held = await admission.admit(sharer, facts, {})
    headers: dict[str, str] = {}
    with pytest.raises(ApiError, match="occupancy share") as info:
        await admission.admit(sharer, facts, headers)
    assert info.value.code is ErrorCode.RATE_LIMIT_EXCEEDED and headers["Retry-After"] == "1"
    assert await admission.admit(who(Quota(), 0.2, "other-key"), facts, {}) is not None
    assert held is not None
    assert admission.key_footprints[("k1", "m")] == 1104
    admission.settle(held, None, answered=True)
    assert ("k1", "m") not in admission.key_footprints
    # Input tokens per minute: charged with the estimate before the request goes out.
    itpm = who(Quota(input_tokens_per_minute=150), key="k2")
    assert await admission.admit(itpm, facts, {}) is not None  # 104 of 150
    with pytest.raises(ApiError, match="input token rate"):
        await admission.admit(itpm, facts, {})
    # Output tokens per minute: charged after the answer; a drained bucket refuses the next.
    otpm = who(Quota(output_tokens_per_minute=100), key="k3")
    first = await admission.admit(otpm, facts, {})
    assert first is not None
    admission.settle(first, Usage(input_tokens=104, output_tokens=500), answered=True)
    with pytest.raises(ApiError, match="output token rate"):
        await admission.admit(otpm, facts, {})


async def test_reserved_mode_ignores_per_key_limits() -> None:
    admission = _admission("admit_budget_tokens: 10000\nrouting_policy: {strategy: least-loaded}\n")
    facts = parse("/v1/chat/completions", CHAT + b', "max_tokens": 1000}')
    strict = who(Quota(input_tokens_per_minute=1), share=0.01)
    assert await admission.admit(strict, facts, {}) is not None


async def test_undeclared_output_grows_the_reservation_and_all_of_it_is_released() -> None:
    admission = _admission(
        "mode: serverless\nadmit_budget_tokens: 10000\nrouting_policy: {strategy: least-loaded}\n"
    )
    facts = parse("/v1/chat/completions", CHAT + b"}")  # no max_tokens: 104 tokens at first
    admitted = await admission.admit(who(Quota(input_tokens_per_minute=0), share=1.0), facts, {})
    assert admitted is not None and admitted.grows
    admitted.grow(50)
    pool = admission.pools["m"]
    assert pool.tokens == 154 and admission.key_footprints[("k1", "m")] == 154
    admission.settle(admitted, None, answered=True)
    assert pool.tokens == 0 and ("k1", "m") not in admission.key_footprints
    declared = await admission.admit(
        who(Quota()), parse("/v1/chat/completions", CHAT + b', "max_tokens": 5}'), {}
    )
    assert declared is not None and not declared.grows
    declared.grow(50)
    assert pool.tokens == 109
    admission.settle(declared, None, answered=True)


async def test_exact_input_replaces_the_estimate_once() -> None:
    from hivenet_router.router.usage import stream_input_tokens

    admission = _admission("admit_budget_tokens: 10000\nrouting_policy: {strategy: least-loaded}\n")
    facts = parse("/v1/messages", CHAT + b', "max_tokens": 10}')  # estimate 104 + 10
    admitted = await admission.admit(who(Quota()), facts, {})
    assert admitted is not None and admission.pools["m"].tokens == 114
    first = (
        b'event: message_start\ndata: {"type": "message_start", "message": '
        b'{"usage": {"input_tokens": 80, "output_tokens": 1}}}\n\n'
    )
    exact = stream_input_tokens(first)
    assert exact == 80
    admitted.exact_input(exact)
    admitted.exact_input(exact)
    assert admission.pools["m"].tokens == 90
    admission.settle(admitted, None, answered=True)
    assert admission.pools["m"].tokens == 0
    assert stream_input_tokens(b'data: {"choices": []}\n\n') is None


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["admit", "grow", "exact", "end"]),
            st.integers(min_value=0, max_value=9),
            st.integers(min_value=1, max_value=400),
        ),
        max_size=60,
    )
)
def test_occupancy_arithmetic_under_any_interleaving(steps: list[tuple[str, int, int]]) -> None:
    """Whatever the order of admissions, growth, true-ups and endings: admission never
    crosses the budget or the backstop, nothing goes negative, and the pool returns to
    zero once every request has ended."""

    async def run() -> None:
        admission = Admission(
            ManualClock(),
            lambda m: parse_policy(
                "admit_budget_tokens: 1000\nmax_inflight: 3\n"
                "routing_policy: {strategy: least-loaded}\n",
                "p",
                "p",
                require_models=False,
            ),
            lambda m: [],
            park_timeout=0.0,
        )
        held: dict[int, object] = {}
        for action, slot, amount in steps:
            pool = admission.pools.get("m")
            if action == "admit" and slot not in held:
                before = (pool.tokens, pool.inflight) if pool else (0, 0)
                # Odd amounts leave output undeclared, so those reservations grow.
                body = (
                    CHAT
                    + (b', "max_tokens": ' + str(amount).encode() if amount % 2 == 0 else b"")
                    + b"}"
                )
                try:
                    admitted = await admission.admit(
                        who(Quota()), parse("/v1/chat/completions", body), {}
                    )
                except ApiError:
                    continue
                assert admitted is not None
                held[slot] = admitted
                pool = admission.pools["m"]
                assert pool.inflight <= 3
                assert before[1] == 0 or before[0] + admitted.footprint <= 900
            elif action == "grow" and slot in held:
                held[slot].grow(amount)  # type: ignore[attr-defined]
            elif action == "exact" and slot in held:
                held[slot].exact_input(amount)  # type: ignore[attr-defined]
            elif action == "end" and slot in held:
                admission.settle(held.pop(slot), None, answered=True)  # type: ignore[arg-type]
            pool = admission.pools.get("m")
            if pool is not None:
                assert pool.tokens >= 0 and pool.inflight >= 0
        for admitted in held.values():
            admission.settle(admitted, None, answered=True)  # type: ignore[arg-type]
        pool = admission.pools.get("m")
        assert pool is None or (pool.tokens, pool.inflight) == (0, 0)

    asyncio.run(run())


async def test_per_key_token_rates_are_kept_per_model() -> None:
    admission = _admission(
        "mode: serverless\nadmit_budget_tokens: 10000\nrouting_policy: {strategy: least-loaded}\n"
    )
    key = who(Quota(input_tokens_per_minute=150))
    first = parse("/v1/chat/completions", CHAT + b', "max_tokens": 1}')  # 104 input tokens
    other = parse("/v1/chat/completions", CHAT.replace(b'"m"', b'"m2"') + b', "max_tokens": 1}')
    assert await admission.admit(key, first, {}) is not None
    with pytest.raises(ApiError, match="input token rate"):
        await admission.admit(key, first, {})
    # The same key on another model draws on a bucket of its own, as the reference keeps them.
    assert await admission.admit(key, other, {}) is not None
    assert set(admission.input_rates) == {("k1", "m"), ("k1", "m2")}


async def test_completions_are_admitted_and_charged_like_chat() -> None:
    admission = _admission("max_input_tokens: 50\nrouting_policy: {strategy: least-loaded}\n")
    prompt = b'{"model": "m", "prompt": "' + b"x" * 320 + b'", "max_tokens": 64}'
    with pytest.raises(ApiError) as info:
        await admission.admit(who(Quota()), parse("/v1/completions", prompt), {})
    assert info.value.code is ErrorCode.INPUT_TOO_LONG
    small = b'{"model": "m", "prompt": "hello", "max_tokens": 64}'
    budget = who(Quota(tokens_per_day=100))
    admitted = await admission.admit(budget, parse("/v1/completions", small), {})
    assert admitted is not None and admitted.charged == 66  # 2 estimated + 64 declared
    assert admission.daily.used("t") == 66
    with pytest.raises(ApiError) as refused:
        await admission.admit(budget, parse("/v1/completions", small), {})
    assert refused.value.code is ErrorCode.TOKEN_LIMIT_EXCEEDED
    admission.settle(admitted, Usage(input_tokens=2, output_tokens=64), answered=True)
    assert admission.daily.used("t") == 66


async def test_idle_state_of_100000_keys_is_forgotten() -> None:
    """Every key and model ever seen leaves buckets behind; the sweep forgets the idle ones,
    and memory returns to where it was before the keys came."""
    clock = ManualClock()
    policy = parse_policy(
        "mode: serverless\nadmit_budget_tokens: 100000000\n"
        "routing_policy: {strategy: least-loaded}\n",
        "p.yaml",
        "p",
        require_models=False,
    )
    admission = Admission(clock, lambda model: policy, lambda model: [], park_timeout=0.05)
    quota = Quota(
        requests_per_minute=10,
        tokens_per_day=10_000,
        input_tokens_per_minute=10_000,
        output_tokens_per_minute=10_000,
    )
    facts = parse("/v1/chat/completions", CHAT + b', "max_tokens": 10}')

    async def wave(keys: range) -> None:
        for index in keys:
            principal = Principal(f"tenant-{index}", f"key-{index}", "n", frozenset(), quota, 0.5)
            admitted = await admission.admit(principal, facts, {})
            assert admitted is not None
            admission.settle(admitted, Usage(input_tokens=100, output_tokens=10), answered=True)

    def held() -> int:
        return (
            len(admission.rates)
            + len(admission.daily)
            + len(admission.input_rates)
            + len(admission.output_rates)
            + len(admission.pools)
        )

    await wave(range(10))  # warm up the interpreter's caches and the model's pool
    clock.advance(86_400)
    admission.sweep()
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        await wave(range(100_000))
        assert len(admission.rates) == 100_000 and len(admission.daily) == 100_000
        assert len(admission.input_rates) == 100_000 and len(admission.output_rates) == 100_000
        grown = tracemalloc.get_traced_memory()[0]
        assert grown - before > 20_000_000  # the state really exists (about 250 B a key)
        clock.advance(86_400)  # a day later: buckets refilled, yesterday's totals past
        admission.sweep()
        gc.collect()
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert held() == 0
    assert after - before < 200_000, (before, grown, after)
