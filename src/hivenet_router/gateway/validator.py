"""The stream-quality validator stage (stub)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from hivenet_router.domain.answer import Answer
from hivenet_router.pipeline.stage import Next
from hivenet_router.pipeline.ticket import Ticket
from hivenet_router.policy.document import Policy

Fallback = Callable[[Ticket], Awaitable[Answer]]


class StreamValidator:
    name = "validator"

    def __init__(self, policy_for: Callable[[str], Policy], provider: Fallback) -> None:
        self.policy_for = policy_for
        self.provider = provider  # the policy's cloud provider for this ticket

    async def __call__(self, ticket: Ticket, next: Next) -> Answer:
        return await next(ticket)
