"""The request rate (requests per minute), as the first stage after authentication.

It runs before every stage that takes a shared resource (the wallet hold in the ledger,
the cache and its flights, occupancy, the daily budget), so a tenant flooding past its
rate is refused before it loads the ledger's connection pool or joins a flight, and every
request it lets through counts: answers from the cache and requests that follow an
identical one in flight count toward the rate like any other.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from hivenet_router.domain.answer import Answer
from hivenet_router.domain.errors import ApiError, ErrorCode
from hivenet_router.observability.events import Refused
from hivenet_router.pipeline.stage import Next
from hivenet_router.pipeline.ticket import Ticket
from hivenet_router.policy.signals import AgentFacts
from hivenet_router.state.ports import Counter

REASON = "b4_rpm"  # the refusal's name in events and metrics, as before the split


class RequestRate:
    """One bucket per owner (flat quotas) or per owner and model (per-model quotas, scaled
    by healthy replicas and skipped when there are none)."""

    name = "rate"

    def __init__(self, rates: Counter, healthy: Callable[[str], list[AgentFacts]]) -> None:
        self.rates = rates
        self._healthy = healthy

    async def __call__(self, ticket: Ticket, next: Next) -> Answer:
        facts = ticket.facts
        assert facts is not None
        await self.charge(ticket, facts.model)
        return await next(ticket)

    async def charge(self, ticket: Ticket, model: str) -> None:
        """Count this request; raise ApiError (after telling the observers) when over."""
        principal = ticket.caller
        quota = principal.quota
        if quota.per_model is not None:
            entry = quota.per_model.get(model)
            if entry is None:
                raise _refuse(ticket, f"no quota declared for model {model} on this API key")
            healthy = len(self._healthy(model))
            if healthy == 0:
                return  # let routing give the precise availability error
            rpm, key = entry.rpm_per_replica * healthy, f"{principal.tenant}\x00{model}"
        else:
            rpm, key = quota.requests_per_minute, principal.tenant
        if rpm <= 0:
            return
        verdict = await self.rates.charge(key, 1, rpm)
        if verdict.remaining is not None:
            ticket.headers_out["X-RateLimit-Remaining-Requests"] = str(verdict.remaining)
        if not verdict.ok:
            # The bucket refills continuously: one request's worth within 60/rpm seconds.
            # Without the header SDKs back off blindly (OpenAI's from half a second).
            ticket.headers_out["Retry-After"] = str(max(1, math.ceil(60 / rpm)))
            raise _refuse(ticket, "rate limit exceeded")


def _refuse(ticket: Ticket, message: str) -> ApiError:
    error = ApiError(ErrorCode.RATE_LIMIT_EXCEEDED, message)
    ticket.emit(Refused(REASON, error.code))
    return error
