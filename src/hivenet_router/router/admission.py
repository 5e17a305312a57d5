"""Admission before routing, as a pipeline stage after the rate and before the wallet and cache: the
input estimate and its caps (B1), pressure shedding (B3), token-weighted occupancy (B2), the
per-key serverless limits (B4) and daily token budgets, in the documented order.

Every count lives behind a state port (state/ports.py): rates and daily totals are
Counters, occupancy and per-key shares are Pools. Admission holds what it took in a `Hold`
with one owner: the stage until an answer exists, then that answer, whose close settles it
(true-up with exact usage, refund when nothing was answered, release of the leases).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from hivenet_router.auth.config import Quota
from hivenet_router.auth.providers import Principal
from hivenet_router.clock import Clock
from hivenet_router.domain.answer import Answer, Outcome
from hivenet_router.domain.errors import ApiError, ErrorCode
from hivenet_router.domain.request import RequestFacts, Usage
from hivenet_router.domain.usage import stream_input_tokens
from hivenet_router.gateway.cache import BILLED
from hivenet_router.observability.events import Admitted, Refused
from hivenet_router.pipeline.output_bound import apply_bound, least_output
from hivenet_router.pipeline.stage import Next
from hivenet_router.pipeline.ticket import Ticket
from hivenet_router.policy.document import Policy
from hivenet_router.policy.gates import OPERATORS
from hivenet_router.policy.signals import SIGNALS, AgentFacts
from hivenet_router.router.dispatch import LEAVE_POOL
from hivenet_router.state.ports import Lease, Ports

_NOTHING = Usage(0, 0)
START_TOKENS_PER_BYTE = 1 / 3.2
MESSAGE_OVERHEAD = 4  # tokens of role and framing per message, text or not
LEARN_WEIGHT = 0.2
RATIO_BOUNDS = (0.05, 1.0)

# Every route that generates tokens goes through B1 to B4 and the daily budget. The Go
# router left /v1/completions out, which let a key past its daily budget keep generating.
GENERATING_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/messages"})
# Routes that read input and generate none: their input counts against the daily budget
# (tokens_per_day is input plus output), as the audit record, the tenant's token series
# and /admin/usage count it; no other gate applies to them.
INPUT_ROUTES = frozenset({"/v1/embeddings", "/v1/rerank"})


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


def budget_for(tenant: str, quota: Quota, model: str) -> tuple[str, int]:
    """The daily budget key and limit that apply to this tenant and model."""
    if quota.per_model is not None:
        entry = quota.per_model.get(model)
        return f"{tenant}\x00{model}", entry.tokens_per_day if entry else 0
    return tenant, quota.tokens_per_day


@dataclass(slots=True)
class Hold:
    """What admission took for one request, settled exactly once when it ends."""

    admission: Admission
    facts: RequestFacts
    estimate: int  # the estimated input part of the reservation
    grows: bool  # output undeclared: the reservation grows as tokens stream
    leases: list[Lease] = field(default_factory=list)
    budget_key: str = ""
    charged: int = 0  # daily tokens charged on admission (the worst case)
    key_ref: str = ""  # serverless: the key and model the token rates are kept under
    output_rate: int = 0  # serverless: output tokens per minute, its bound charged
    input_rate: int = 0  # serverless: input tokens per minute, the estimate charged
    estimate_charged: int = 0  # the input estimate the input rate was charged
    output: int = 0  # the output bound held (0: none, output undeclared and unbounded)
    _owner: Answer | None = None
    _settled: bool = False

    def exact_input(self, tokens: int) -> None:
        """Replace the estimated input part of the reservation with the backend's count."""
        if tokens <= 0 or not self.estimate:
            return
        for lease in self.leases:
            lease.grow(tokens - self.estimate)
        self.estimate = 0  # once

    def grow(self, tokens: int) -> None:
        """Add streamed output to the reservation (only when no max_tokens was declared)."""
        if self.grows and tokens > 0:
            for lease in self.leases:
                lease.grow(tokens)

    def leave_pool(self) -> None:
        """Give back the occupancy reservations early (routing left the local pool)."""
        for lease in self.leases:
            lease.release()

    def hand_to(self, answer: Answer, billed: Callable[[], bool] = lambda: True) -> None:
        """From now on the answer owns this hold: its close settles it. An answer the cache
        served unbilled (`bill_hits: false`) counts against no token limit."""
        self._owner = answer
        # The input counted for an answer that reports none: the estimate learned from
        # this model's exact usage (Estimator), not the fixed starting ratio.
        answer.input_estimate = self.estimate
        first = answer.first
        if first is not None:
            exact = stream_input_tokens(first)
            if exact is not None:
                self.exact_input(exact)
        if self.grows and answer.streamed and self.leases:
            # about one token per SSE event: enough to keep occupancy honest (what is
            # billed is the answer's usage, domain/answer.py)
            answer.on_chunk(
                lambda chunk: self.grow(chunk.count(b"data:") - chunk.count(b"data: [DONE]"))
            )
        answered = answer.status < 400  # an error answer generated nothing
        answer.on_close(
            lambda outcome, usage: self.settle(
                usage if billed() else _NOTHING, answered, outcome is not Outcome.OK
            )
        )

    async def settle(self, usage: Usage | None, answered: bool, cut: bool = False) -> None:
        if self._settled:
            return
        self._settled = True
        await self.admission.settle(self, usage, answered, cut)

    async def __aenter__(self) -> Hold:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._owner is None:
            await self.settle(None, answered=False)


class Admission:
    """The gates in the documented order, as a pipeline stage."""

    name = "admission"

    def __init__(
        self,
        clock: Clock,
        healthy: Callable[[str], list[AgentFacts]],
        ports: Ports,
        admit_fraction: float = 0.9,
        park_timeout: float = 0.25,
    ) -> None:
        self.admit_fraction = admit_fraction
        self.park_timeout = park_timeout
        self.ports = ports
        self.limits: dict[str, tuple[int, int]] = {}  # last effective (budget, backstop)
        self.estimator = Estimator()
        self._clock = clock
        self._healthy = healthy

    async def __call__(self, ticket: Ticket, next: Next) -> Answer:
        facts = ticket.facts
        assert facts is not None
        hold = await self.admit(ticket, ticket.caller, facts)
        ticket.admitted = True
        if hold is None:
            ticket.emit(Admitted())
            return await next(ticket)
        async with hold:
            ticket.emit(Admitted())
            ticket.put(LEAVE_POOL, hold.leave_pool)
            answer = await next(ticket)
            hold.hand_to(answer, lambda: ticket.get(BILLED))
        return answer

    def sweep(self) -> None:
        """Forget idle state held by the ports (run every few minutes)."""
        for port in _ports_of(self.ports):
            sweep = getattr(port, "sweep", None)
            if sweep is not None:
                sweep()

    # -- the gates --------------------------------------------------------------------------

    async def admit(self, ticket: Ticket, principal: Principal, facts: RequestFacts) -> Hold | None:
        """Raise ApiError to refuse (after telling the observers which gate refused). The
        request rate is not here: it is counted earlier, by the rate stage (router/rate.py)."""
        if facts.route not in GENERATING_ROUTES:
            if facts.route in INPUT_ROUTES:
                return await self._input_only(ticket, principal, facts)
            return None
        model = facts.model
        estimate = self.estimator.estimate(model, facts.text_bytes, facts.messages)
        policy = ticket.policy
        self._caps(ticket, policy, facts, estimate)
        bound = await self._bound(ticket, principal, policy, facts, estimate)
        worst = estimate + bound
        hold = Hold(self, facts, estimate, not bound)
        hold.output = bound
        try:
            serverless = policy.mode == "serverless"
            if policy.shed_if or policy.admit_budget_tokens or policy.max_inflight or serverless:
                healthy = self._healthy(model)  # only when a pool gate needs it
                self._shed(ticket, policy, healthy)
                await self._occupy(ticket, policy, hold, worst, len(healthy))
                if serverless:
                    await self._per_key(ticket, principal, policy, hold, worst, len(healthy))
            await self._daily(ticket, principal, hold, worst)
        except BaseException:
            # A later refusal gives back what earlier gates took.
            await hold.settle(None, answered=False)
            raise
        if hold.output:  # _daily may have lowered it
            apply_bound(ticket, hold.output)
        return hold

    async def _input_only(self, ticket: Ticket, principal: Principal, facts: RequestFacts) -> Hold:
        """An embedding or rerank request: its input estimate against the daily budget,
        trued up with the answer's usage like any other."""
        estimate = self.estimator.estimate(facts.model, facts.text_bytes, facts.messages)
        hold = Hold(self, facts, estimate, False)
        try:
            await self._daily(ticket, principal, hold, estimate)
        except BaseException:
            await hold.settle(None, answered=False)
            raise
        return hold

    async def _bound(
        self,
        ticket: Ticket,
        principal: Principal,
        policy: Policy,
        facts: RequestFacts,
        estimate: int,
    ) -> int:
        """The output bound held for the request: the declared limit (times n) or the
        policy's default, lowered to the key's output rate left and, for a default, to its
        daily budget left. Below `min_output_tokens` the limit that lowered it refuses."""
        declared = facts.max_output_tokens
        bound = declared if declared is not None else policy.default_max_tokens
        if not bound:
            return 0
        # Every choice gets one token at least: a default under that is raised to it, and
        # a bound lowered under it is refused (a request of n = 3,000 on a key with 995
        # tokens left was held at 995 and given 1 a choice, 3,000 in all).
        choices = facts.choices
        bound = max(bound, choices)
        least = least_output(bound, choices, policy.min_output_tokens)
        quota = principal.quota
        rate = quota.output_tokens_per_minute if policy.mode == "serverless" else 0
        if rate:
            key = f"{principal.key_ref}\x00{facts.model}"
            left = await self.ports.output_rates.left(key, rate)
            if left < least:
                ticket.headers_out["Retry-After"] = str(_wait(left, least, rate))
                raise self._refuse(
                    ticket,
                    "b4_otpm",
                    ApiError(ErrorCode.RATE_LIMIT_EXCEEDED, "output token rate exceeded"),
                )
            bound = min(bound, math.floor(left))
        if declared is None:
            key, limit = budget_for(principal.tenant, quota, facts.model)
            if limit > 0:
                remaining = await self.ports.daily.left(key, limit)
                left = remaining - estimate
                if left < least:
                    # As the budget's own refusal below says: what is left today.
                    ticket.headers_out["X-RateLimit-Remaining-Tokens"] = str(
                        max(0, math.floor(remaining))
                    )
                    raise self._refuse(ticket, "daily", _no_budget(declared=False))
                bound = min(bound, math.floor(left))
        return bound

    def _refuse(self, ticket: Ticket, reason: str, error: ApiError) -> ApiError:
        ticket.emit(Refused(reason, error.code))
        if reason == "daily":
            # The budget is back at the next UTC midnight: say so, and tell the SDKs
            # (which retry a 429 at once) that retrying sooner cannot help.
            wall = self._clock.wall()
            ticket.headers_out["Retry-After"] = str(max(1, math.ceil(86_400 - wall % 86_400)))
            ticket.headers_out["x-should-retry"] = "false"
        return error

    def _caps(self, ticket: Ticket, policy: Policy, facts: RequestFacts, estimate: int) -> None:
        """B1: the learned input estimate and the image count against the policy's caps."""
        if policy.max_input_tokens and estimate > policy.max_input_tokens:
            raise self._refuse(
                ticket,
                "b1",
                ApiError(
                    ErrorCode.INPUT_TOO_LONG,
                    f"input is {estimate} tokens, over the model limit of "
                    f"{policy.max_input_tokens}",
                ),
            )
        if policy.images_max and facts.images > policy.images_max:
            raise self._refuse(
                ticket,
                "b1",
                ApiError(
                    ErrorCode.INPUT_TOO_LONG,
                    f"request carries {facts.images} images, over the model limit of "
                    f"{policy.images_max}",
                ),
            )

    def _shed(self, ticket: Ticket, policy: Policy, healthy: list[AgentFacts]) -> None:
        """B3: average each shed signal over the healthy pool; missing signals pass."""
        for gate in policy.shed_if:
            values = [v for agent in healthy if (v := SIGNALS[gate.signal](agent)) is not None]
            if values and OPERATORS[gate.op](sum(values) / len(values), gate.threshold):
                ticket.headers_out["Retry-After"] = "1"
                raise self._refuse(
                    ticket,
                    "b3",
                    ApiError(
                        ErrorCode.CONCURRENCY_LIMIT_EXCEEDED,
                        "model is under high load, please retry",
                    ),
                )

    async def _occupy(
        self, ticket: Ticket, policy: Policy, hold: Hold, footprint: int, replicas: int
    ) -> None:
        """B2: reserve the footprint against the replica-scaled budget and backstop."""
        if not (policy.admit_budget_tokens or policy.max_inflight):
            return
        replicas = max(1, replicas)
        budget = math.floor(self.admit_fraction * policy.admit_budget_tokens * replicas)
        backstop = policy.max_inflight * replicas
        model = hold.facts.model
        self.limits[model] = (budget, backstop)
        lease = await self.ports.occupancy.reserve(
            model, footprint, budget, self.park_timeout, backstop
        )
        if lease is None:
            ticket.headers_out["Retry-After"] = "1"
            raise self._refuse(
                ticket,
                "b2",
                ApiError(
                    ErrorCode.CONCURRENCY_LIMIT_EXCEEDED,
                    "server at capacity for this model, please retry",
                ),
            )
        hold.leases.append(lease)

    async def _per_key(
        self,
        ticket: Ticket,
        principal: Principal,
        policy: Policy,
        hold: Hold,
        footprint: int,
        replicas: int,
    ) -> None:
        """B4, serverless mode, per key and model: the key's occupancy share, then its
        output and input token rates. Refusals are 429 rate_limit_exceeded with
        Retry-After: 1."""
        key, quota = f"{principal.key_ref}\x00{hold.facts.model}", principal.quota

        def refuse(reason: str, message: str) -> ApiError:
            ticket.headers_out.setdefault("Retry-After", "1")
            return self._refuse(ticket, reason, ApiError(ErrorCode.RATE_LIMIT_EXCEEDED, message))

        if principal.occupancy_share and policy.admit_budget_tokens:
            limit = principal.occupancy_share * policy.admit_budget_tokens * max(1, replicas)
            lease = await self.ports.shares.reserve(key, footprint, math.floor(limit), 0.0)
            if lease is None:
                raise refuse("b4_occupancy", "per-key occupancy share exceeded, please retry")
            hold.leases.append(lease)
        if quota.output_tokens_per_minute:
            # The output bound is taken now (it fits: _bound lowered it to what was left)
            # and trued up with exact usage, into debt if an engine passed it.
            rate = quota.output_tokens_per_minute
            if not (await self.ports.output_rates.charge(key, hold.output, rate)).ok:
                left = await self.ports.output_rates.left(key, rate)
                ticket.headers_out["Retry-After"] = str(_wait(left, hold.output, rate))
                raise refuse("b4_otpm", "output token rate exceeded, please retry")
            hold.output_rate = rate
        if quota.input_tokens_per_minute:
            rate = quota.input_tokens_per_minute
            verdict = await self.ports.input_rates.charge(key, hold.estimate, rate)
            if not verdict.ok:
                left = await self.ports.input_rates.left(key, rate)
                ticket.headers_out["Retry-After"] = str(_wait(left, hold.estimate, rate))
                raise refuse("b4_itpm", "input token rate exceeded, please retry")
            hold.input_rate, hold.estimate_charged = rate, hold.estimate
        hold.key_ref = key

    async def _daily(self, ticket: Ticket, principal: Principal, hold: Hold, worst: int) -> None:
        """The worst case (estimate plus declared output) against what is left today."""
        key, limit = budget_for(principal.tenant, principal.quota, hold.facts.model)
        verdict = await self.ports.daily.charge(key, worst, limit)
        least = least_output(hold.output, hold.facts.choices, ticket.policy.min_output_tokens)
        if not verdict.ok and hold.facts.max_output_tokens is None and hold.output:
            # A default bound read against what was left before the gates in between (a
            # concurrent request, another router's spend) is lowered again, not refused.
            output = (verdict.remaining or 0) - hold.estimate
            if output >= least:
                await self._lower(hold, output)
                worst = hold.estimate + output
                verdict = await self.ports.daily.charge(key, worst, limit)
        if verdict.remaining is not None:
            ticket.headers_out["X-RateLimit-Remaining-Tokens"] = str(verdict.remaining)
        if not verdict.ok:
            if hold.facts.route in INPUT_ROUTES:
                refusal = ApiError(
                    ErrorCode.TOKEN_LIMIT_EXCEEDED, "insufficient daily token budget for the input"
                )
            else:
                refusal = _no_budget(declared=hold.facts.max_output_tokens is not None)
            raise self._refuse(ticket, "daily", refusal)
        hold.budget_key, hold.charged = key, worst if limit > 0 else 0

    async def _lower(self, hold: Hold, output: int) -> None:
        """Lower the output bound the earlier gates took."""
        delta, hold.output = output - hold.output, output
        for lease in hold.leases:
            lease.grow(delta)
        if hold.output_rate:
            await self.ports.output_rates.adjust(hold.key_ref, delta, hold.output_rate)

    # -- settlement ---------------------------------------------------------------------------

    async def settle(
        self, hold: Hold, usage: Usage | None, answered: bool, cut: bool = False
    ) -> None:
        """Release the leases, true up the daily budget with exact usage, refund a request
        nobody answered, charge the output rate and teach the estimator. `cut`: the answer
        ended early (client gone, broken, timed out)."""
        hold.leave_pool()
        await self._true_up_rates(hold, usage, answered)
        if hold.charged:
            if not answered:
                spent = 0
            elif usage is not None:
                # The answer's one meter: reported usage, or for a stream that reported
                # none (or was cut before its report) the output counted from its text.
                spent = usage.input_tokens + usage.output_tokens
            else:
                spent = hold.charged  # unknown usage keeps the worst case
            await self.ports.daily.settle(hold.budget_key, hold.charged, spent)
        estimated = hold._owner is not None and hold._owner.usage_estimated
        if usage is not None and not estimated:  # learn only from what an engine counted
            facts = hold.facts
            if not facts.images:
                self.estimator.learn(
                    facts.model, facts.text_bytes, facts.messages, usage.input_tokens
                )

    async def _true_up_rates(self, hold: Hold, usage: Usage | None, answered: bool) -> None:
        """Replace what the token rates were charged at admission with exact usage; a
        request nobody answered gives its charge back. Unknown usage keeps the bound (and
        the input estimate): the worst case the request could have spent."""
        ports, key = self.ports, hold.key_ref
        if hold.output_rate:
            if not answered:
                spent = 0
            elif usage is not None:
                spent = usage.output_tokens
            else:
                spent = hold.output  # unknown usage keeps the bound
            if spent != hold.output:
                await ports.output_rates.adjust(key, spent - hold.output, hold.output_rate)
        if hold.input_rate and hold.estimate_charged:
            if not answered:
                await ports.input_rates.adjust(key, -hold.estimate_charged, hold.input_rate)
            elif usage is not None and usage.input_tokens != hold.estimate_charged:
                delta = usage.input_tokens - hold.estimate_charged
                await ports.input_rates.adjust(key, delta, hold.input_rate)


def _wait(left: float, needed: float, rate: float) -> int:
    """Whole seconds until a bucket refilling `rate` a minute holds `needed` again (it
    holds `left` now, negative in debt)."""
    return max(1, math.ceil((needed - left) * 60 / rate))


def _no_budget(declared: bool = True) -> ApiError:
    if declared:  # the reference's words
        return ApiError(
            ErrorCode.TOKEN_LIMIT_EXCEEDED,
            "insufficient daily token budget for requested max_tokens",
        )
    return ApiError(
        ErrorCode.TOKEN_LIMIT_EXCEEDED,
        "insufficient daily token budget for the prompt and the least output the request "
        "can be given (it declares no max_tokens)",
    )


def _ports_of(ports: Ports) -> tuple[object, ...]:
    return (
        ports.rates,
        ports.daily,
        ports.input_rates,
        ports.output_rates,
        ports.occupancy,
        ports.shares,
    )
