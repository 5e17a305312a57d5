"""Admission before routing: request rates, the input estimate and its caps, daily token
budgets, pressure shedding (B3) and token-weighted occupancy (B2). Logic over an injected
clock; every check-and-charge is one synchronous step.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from hivenet_router.auth.config import Quota
from hivenet_router.auth.providers import Principal
from hivenet_router.clock import Clock
from hivenet_router.domain.errors import ApiError, ErrorCode
from hivenet_router.policy.document import Policy
from hivenet_router.policy.gates import OPERATORS
from hivenet_router.policy.signals import SIGNALS, AgentFacts
from hivenet_router.router.bodies import RequestFacts
from hivenet_router.router.usage import Usage

V = TypeVar("V")

START_TOKENS_PER_BYTE = 1 / 3.2
MESSAGE_OVERHEAD = 4  # tokens of role and framing per message, text or not
LEARN_WEIGHT = 0.2
RATIO_BOUNDS = (0.05, 1.0)


class Estimator:
    """One learned input estimate per request: text bytes times a per-model tokens-per-byte
    ratio (starting at 1/3.2), plus a per-message overhead. Exact backend usage teaches the
    ratio (EWMA 0.2, clamped), except for requests carrying images."""

    def __init__(self) -> None:
        self._ratio: dict[str, float] = {}

    def ratio(self, model: str) -> float:
        return self._ratio.get(model, START_TOKENS_PER_BYTE)

    def estimate(self, model: str, text_bytes: int, messages: int) -> int:
        return math.ceil(text_bytes * self.ratio(model)) + MESSAGE_OVERHEAD * messages

    def learn(self, model: str, text_bytes: int, messages: int, exact_input: int) -> None:
        if text_bytes <= 0 or exact_input <= 0:
            return
        observed = (exact_input - MESSAGE_OVERHEAD * messages) / text_bytes
        observed = min(max(observed, RATIO_BOUNDS[0]), RATIO_BOUNDS[1])
        self._ratio[model] = (1 - LEARN_WEIGHT) * self.ratio(model) + LEARN_WEIGHT * observed


class TokenBucket:
    """A continuously refilling bucket: `capacity` units, refilled at `per_second`."""

    def __init__(self, capacity: float, per_second: float, now: float) -> None:
        self.capacity = capacity
        self.per_second = per_second
        self.level = capacity
        self.stamp = now

    def resize(self, capacity: float, per_second: float) -> None:
        self.capacity, self.per_second = capacity, per_second
        self.level = min(self.level, capacity)

    def full(self, now: float) -> bool:
        """Refilled to capacity by `now`: nothing would change if it were forgotten."""
        return self.level + (now - self.stamp) * self.per_second >= self.capacity

    def take(self, now: float, amount: float = 1.0) -> bool:
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.per_second)
        self.stamp = now
        if self.level < amount:
            return False
        self.level -= amount
        return True


@dataclass(frozen=True, slots=True)
class Verdict:
    ok: bool
    message: str = ""
    remaining: int | None = None  # finite limits only


class RequestRates:
    """Requests per minute: one bucket per tenant (flat quotas) or per tenant and model
    (per-model quotas, scaled by healthy replicas and skipped when there are none)."""

    def __init__(self, clock: Clock, burst_seconds: int = 0) -> None:
        self._clock = clock
        self._burst = burst_seconds
        self._buckets: dict[tuple[str, str], TokenBucket] = {}

    def admit(self, tenant: str, quota: Quota, model: str, healthy: int) -> Verdict:
        if quota.per_model is not None:
            entry = quota.per_model.get(model)
            if entry is None:
                return Verdict(False, f"no quota declared for model {model} on this API key")
            if healthy == 0:
                return Verdict(True)  # let routing give the precise availability error
            rpm, key = entry.rpm_per_replica * healthy, (tenant, model)
        else:
            rpm, key = quota.requests_per_minute, (tenant, "")
        if rpm <= 0:
            return Verdict(True)
        capacity = float(rpm) if not self._burst else max(1.0, math.floor(rpm * self._burst / 60))
        now = self._clock.monotonic()
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = TokenBucket(capacity, rpm / 60.0, now)
        elif bucket.capacity != capacity:
            bucket.resize(capacity, rpm / 60.0)
        ok = bucket.take(now)
        return Verdict(ok, "" if ok else "rate limit exceeded", int(bucket.level))

    def sweep(self) -> None:
        """Forget buckets that have refilled: a new one would start in the same state."""
        now = self._clock.monotonic()
        self._buckets = {k: b for k, b in self._buckets.items() if not b.full(now)}

    def __len__(self) -> int:
        return len(self._buckets)


class DailyTokens:
    """Tokens used per budget key and UTC day. Charged on admission with the worst case
    (input estimate plus requested output), trued up with exact usage afterwards."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._used: dict[tuple[str, str], int] = {}
        self._day_cache = (-1, "")

    def _day(self) -> str:
        number = int(self._clock.wall() // 86_400)
        if number != self._day_cache[0]:
            self._day_cache = (number, time.strftime("%Y-%m-%d", time.gmtime(number * 86_400)))
        return self._day_cache[1]

    def charge(self, key: str, amount: int, limit: int) -> Verdict:
        if limit <= 0:
            return Verdict(True)
        slot = (key, self._day())
        used = self._used.get(slot, 0)
        if used + amount > limit:
            return Verdict(
                False,
                "insufficient daily token budget for requested max_tokens",
                max(0, limit - used),
            )
        self._used[slot] = used + amount
        return Verdict(True, remaining=limit - used - amount)

    def adjust(self, key: str, delta: int) -> None:
        slot = (key, self._day())
        if slot in self._used:
            self._used[slot] = max(0, self._used[slot] + delta)

    def sweep(self) -> None:
        """Forget totals of past UTC days."""
        day = self._day()
        self._used = {k: v for k, v in self._used.items() if k[1] == day}

    def __len__(self) -> int:
        return len(self._used)

    def used(self, key: str) -> int:
        return self._used.get((key, self._day()), 0)

    def today(self) -> tuple[str, dict[str, int]]:
        """Today's UTC date and totals by budget key, for persistence and the admin API."""
        day = self._day()
        return day, {key: used for (key, d), used in self._used.items() if d == day}

    def restore(self, day: str, totals: dict[str, int]) -> None:
        """Put back totals saved earlier; only today's count."""
        if day == self._day():
            for key, used in totals.items():
                self._used[(key, day)] = max(self._used.get((key, day), 0), used)


def budget_for(tenant: str, quota: Quota, model: str) -> tuple[str, int]:
    """The daily budget key and limit that apply to this tenant and model."""
    if quota.per_model is not None:
        entry = quota.per_model.get(model)
        return f"{tenant}\x00{model}", entry.tokens_per_day if entry else 0
    return tenant, quota.tokens_per_day


# Every route that generates tokens goes through B1 to B4 and the daily budget. The Go
# router left /v1/completions out, which let a key past its daily budget keep generating.
GENERATING_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/messages"})
IDLE_POOL_SECONDS = 15 * 60


class Occupancy:
    """Token-weighted work in flight for one model (B2): reserved footprints and a count.

    Check and take happen in one synchronous step; a request that does not fit parks in
    FIFO order until a release makes room or its park timeout passes."""

    def __init__(self, now: float = 0.0) -> None:
        self.tokens = 0
        self.inflight = 0
        self.last_used = now
        self._waiters: deque[asyncio.Future[None]] = deque()

    def idle(self, now: float, after: float) -> bool:
        return not self.inflight and not self._waiters and now - self.last_used >= after

    def _fits(self, footprint: int, budget: int, backstop: int) -> bool:
        if backstop and self.inflight >= backstop:
            return False
        # Alone in the pool, even an oversized request runs: nothing else can free room.
        return not budget or self.inflight == 0 or self.tokens + footprint <= budget

    async def reserve(self, footprint: int, budget: int, backstop: int, park: float) -> bool:
        deadline = asyncio.get_running_loop().time() + park
        while not (not self._waiters and self._fits(footprint, budget, backstop)):
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                return False
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                async with asyncio.timeout(remaining):
                    await waiter
            except TimeoutError:
                return False
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
            if self._fits(footprint, budget, backstop):
                break
        self.tokens += footprint
        self.inflight += 1
        return True

    def release(self, footprint: int, now: float) -> None:
        self.tokens -= footprint
        self.inflight -= 1
        self.last_used = now
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                break


@dataclass(slots=True)
class Admitted:
    """What admission took for one request, to settle exactly once when it ends."""

    model: str
    budget_key: str
    charged: int
    text_bytes: int
    messages: int
    images: int
    occupancy: Occupancy | None = None
    footprint: int = 0
    key_ref: tuple[str, str] = ("", "")  # serverless: (key, model)
    key_pool: dict[tuple[str, str], int] | None = None  # serverless: in-flight footprints
    output_rate: int = 0  # serverless: tokens per minute charged with the output afterwards
    grows: bool = False  # output undeclared: the reservation grows as tokens stream
    estimate: int = 0  # the estimated input part of the footprint

    def exact_input(self, tokens: int) -> None:
        """Replace the estimated input part of the reservation with the backend's count."""
        if tokens <= 0 or not self.estimate:
            return
        self._add(tokens - self.estimate)
        self.estimate = 0  # once

    def _add(self, tokens: int) -> None:
        if self.occupancy is not None:
            self.occupancy.tokens += tokens
        if self.key_pool is not None:
            self.key_pool[self.key_ref] += tokens
        self.footprint += tokens

    def grow(self, tokens: int) -> None:
        """Add streamed output to the reservation (only when no max_tokens was declared)."""
        if self.grows and tokens > 0:
            self._add(tokens)

    def release(self, now: float) -> None:
        if self.occupancy is not None:
            self.occupancy.release(self.footprint, now)
            self.occupancy = None
        if self.key_pool is not None:
            left = self.key_pool[self.key_ref] - self.footprint
            if left:
                self.key_pool[self.key_ref] = left
            else:
                del self.key_pool[self.key_ref]
            self.key_pool = None


class Admission:
    """The gates in the documented order: request rate (every inference route, count_tokens
    included), then for chat and messages: the input estimate, B1 caps, B3 pressure
    shedding, B2 occupancy, B4 serverless per-key limits (policy `mode: serverless`) and
    the daily budget."""

    def __init__(
        self,
        clock: Clock,
        policy_for: Callable[[str], Policy],
        healthy: Callable[[str], list[AgentFacts]],
        burst_seconds: int = 0,
        admit_fraction: float = 0.9,
        park_timeout: float = 0.25,
    ) -> None:
        self.admit_fraction = admit_fraction
        self.park_timeout = park_timeout
        self.pools: dict[str, Occupancy] = {}
        self.limits: dict[str, tuple[int, int]] = {}  # last effective (budget, backstop)
        # B4 state is kept per key and model, as the reference does.
        self.key_footprints: dict[tuple[str, str], int] = {}
        self.input_rates: dict[tuple[str, str], TokenBucket] = {}
        self.output_rates: dict[tuple[str, str], TokenBucket] = {}
        self._clock = clock
        self.rejections: Callable[[str, str], None] = lambda reason, model: None
        self.estimator = Estimator()
        self.rates = RequestRates(clock, burst_seconds)
        self.daily = DailyTokens(clock)
        self._policy_for = policy_for
        self._healthy = healthy

    async def admit(
        self, principal: Principal, facts: RequestFacts, headers: dict[str, str]
    ) -> Admitted | None:
        """Raise ApiError to refuse; fill `headers` with the values the answer should carry."""
        tenant, quota = principal.tenant, principal.quota
        model = facts.model
        if quota.per_model is not None or quota.requests_per_minute:
            verdict = self.rates.admit(tenant, quota, model, len(self._healthy(model)))
            if verdict.remaining is not None:
                headers["X-RateLimit-Remaining-Requests"] = str(verdict.remaining)
            if not verdict.ok:
                self.rejections("b4_rpm", model)
                raise ApiError(ErrorCode.RATE_LIMIT_EXCEEDED, verdict.message)
        if facts.route not in GENERATING_ROUTES:
            return None
        estimate = self.estimator.estimate(model, facts.text_bytes, facts.messages)
        policy = self._policy_for(model)
        if policy.max_input_tokens and estimate > policy.max_input_tokens:
            self.rejections("b1", model)
            raise ApiError(
                ErrorCode.INPUT_TOO_LONG,
                f"input is {estimate} tokens, over the model limit of {policy.max_input_tokens}",
            )
        if policy.images_max and facts.images > policy.images_max:
            self.rejections("b1", model)
            raise ApiError(
                ErrorCode.INPUT_TOO_LONG,
                f"request carries {facts.images} images, over the model limit of "
                f"{policy.images_max}",
            )
        worst = estimate + (facts.max_output_tokens or 0)
        admitted = Admitted(model, "", 0, facts.text_bytes, facts.messages, facts.images)
        admitted.grows = facts.max_output_tokens is None
        admitted.estimate = estimate
        serverless = policy.mode == "serverless"
        if policy.shed_if or policy.admit_budget_tokens or policy.max_inflight or serverless:
            healthy = self._healthy(model)  # only when a pool gate needs it
            self._shed(policy, model, healthy, headers)
            await self._occupy(policy, admitted, worst, len(healthy), headers)
            if serverless:
                try:
                    self._per_key(
                        principal, policy, admitted, estimate, worst, len(healthy), headers
                    )
                except ApiError:
                    admitted.release(self._clock.monotonic())
                    raise
        key, limit = budget_for(tenant, quota, model)
        verdict = self.daily.charge(key, worst, limit)
        if verdict.remaining is not None:
            headers["X-RateLimit-Remaining-Tokens"] = str(verdict.remaining)
        if not verdict.ok:
            # a later refusal gives back what earlier gates took
            admitted.release(self._clock.monotonic())
            raise ApiError(ErrorCode.TOKEN_LIMIT_EXCEEDED, verdict.message)
        admitted.budget_key, admitted.charged = key, worst if limit > 0 else 0
        return admitted

    def _per_key(
        self,
        principal: Principal,
        policy: Policy,
        admitted: Admitted,
        estimate: int,
        footprint: int,
        replicas: int,
        headers: dict[str, str],
    ) -> None:
        """B4, serverless mode: the key's occupancy share, then its input and output token
        rates. Refusals are 429 rate_limit_exceeded with Retry-After: 1."""
        key, quota, now = (
            (principal.key_ref, admitted.model),
            principal.quota,
            self._clock.monotonic(),
        )

        def refuse(reason: str, message: str) -> ApiError:
            self.rejections(reason, admitted.model)
            headers["Retry-After"] = "1"
            return ApiError(ErrorCode.RATE_LIMIT_EXCEEDED, message)

        if principal.occupancy_share and policy.admit_budget_tokens:
            limit = principal.occupancy_share * policy.admit_budget_tokens * max(1, replicas)
            if self.key_footprints.get(key, 0) + footprint > limit:
                raise refuse("b4_occupancy", "per-key occupancy share exceeded, please retry")
        if quota.output_tokens_per_minute:
            bucket = self._bucket(self.output_rates, key, quota.output_tokens_per_minute, now)
            if not bucket.take(now, 0.0) or bucket.level <= 0:
                raise refuse("b4_otpm", "output token rate exceeded, please retry")
            admitted.output_rate = quota.output_tokens_per_minute
        if quota.input_tokens_per_minute:
            bucket = self._bucket(self.input_rates, key, quota.input_tokens_per_minute, now)
            if not bucket.take(now, float(estimate)):
                raise refuse("b4_itpm", "input token rate exceeded, please retry")
        self.key_footprints[key] = self.key_footprints.get(key, 0) + footprint
        admitted.key_ref, admitted.key_pool, admitted.footprint = (
            key,
            self.key_footprints,
            footprint,
        )

    @staticmethod
    def _bucket(
        buckets: dict[tuple[str, str], TokenBucket],
        key: tuple[str, str],
        per_minute: int,
        now: float,
    ) -> TokenBucket:
        bucket = buckets.get(key)
        if bucket is None or bucket.capacity != per_minute:
            bucket = buckets[key] = TokenBucket(float(per_minute), per_minute / 60.0, now)
        return bucket

    def _shed(
        self, policy: Policy, model: str, healthy: list[AgentFacts], headers: dict[str, str]
    ) -> None:
        """B3: average each shed signal over the healthy pool; missing signals pass."""
        for gate in policy.shed_if:
            values = [v for agent in healthy if (v := SIGNALS[gate.signal](agent)) is not None]
            if values and OPERATORS[gate.op](sum(values) / len(values), gate.threshold):
                self.rejections("b3", model)
                headers["Retry-After"] = "1"
                raise ApiError(
                    ErrorCode.CONCURRENCY_LIMIT_EXCEEDED, "model is under high load, please retry"
                )

    async def _occupy(
        self,
        policy: Policy,
        admitted: Admitted,
        footprint: int,
        replicas: int,
        headers: dict[str, str],
    ) -> None:
        """B2: reserve the footprint against the replica-scaled budget and backstop."""
        if not (policy.admit_budget_tokens or policy.max_inflight):
            return
        replicas = max(1, replicas)
        budget = math.floor(self.admit_fraction * policy.admit_budget_tokens * replicas)
        backstop = policy.max_inflight * replicas
        pool = self.pools.get(admitted.model)
        if pool is None:
            pool = self.pools[admitted.model] = Occupancy(self._clock.monotonic())
        self.limits[admitted.model] = (budget, backstop)
        if not await pool.reserve(footprint, budget, backstop, self.park_timeout):
            self.rejections("b2", admitted.model)
            headers["Retry-After"] = "1"
            raise ApiError(
                ErrorCode.CONCURRENCY_LIMIT_EXCEEDED,
                "server at capacity for this model, please retry",
            )
        admitted.occupancy, admitted.footprint = pool, footprint

    def leave(self, admitted: Admitted) -> None:
        """Give back the occupancy reservation early (the request left the local pool)."""
        admitted.release(self._clock.monotonic())

    def settle(self, admitted: Admitted, usage: Usage | None, answered: bool) -> None:
        """Release the occupancy reservation, true up the daily budget with exact usage,
        refund a request nobody answered, and teach the estimator from text-only prompts."""
        now = self._clock.monotonic()
        admitted.release(now)
        if usage is not None and admitted.output_rate:
            # Looked up again rather than held: a sweep may have dropped a full bucket
            # meanwhile. One answer can drain at most the bucket, never borrow beyond it.
            bucket = self._bucket(self.output_rates, admitted.key_ref, admitted.output_rate, now)
            bucket.take(now, 0.0)
            bucket.level = max(0.0, bucket.level - usage.output_tokens)
        if usage is not None:
            if admitted.charged:
                exact = usage.input_tokens + usage.output_tokens
                self.daily.adjust(admitted.budget_key, exact - admitted.charged)
            if not admitted.images:
                self.estimator.learn(
                    admitted.model, admitted.text_bytes, admitted.messages, usage.input_tokens
                )
        elif not answered and admitted.charged:
            self.daily.adjust(admitted.budget_key, -admitted.charged)

    def sweep(self) -> None:
        """Forget idle state (run every few minutes): request and token-rate buckets that
        have refilled, daily totals of past UTC days, and occupancy pools that have held
        nothing for 15 minutes. Memory then follows the keys in use, not every key ever
        seen; what is forgotten would be recreated in the same state."""
        now = self._clock.monotonic()
        self.rates.sweep()
        self.daily.sweep()
        for buckets in (self.input_rates, self.output_rates):
            _keep(buckets, lambda bucket: not bucket.full(now))
        _keep(self.key_footprints, lambda footprint: footprint != 0)
        idle = [m for m, p in self.pools.items() if p.idle(now, IDLE_POOL_SECONDS)]
        for model in idle:
            del self.pools[model]
            self.limits.pop(model, None)


def _keep(table: dict[Any, V], wanted: Callable[[V], bool]) -> None:
    """Drop unwanted entries in place and give the table's memory back: a dict keeps the
    size it once had until it is cleared (the object stays the same for its holders)."""
    kept = {key: value for key, value in table.items() if wanted(value)}
    table.clear()
    table.update(kept)
