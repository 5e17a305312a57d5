"""The response cache and in-flight deduplication stage (stub)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hivenet_router.clock import Clock
from hivenet_router.domain.answer import Answer
from hivenet_router.pipeline.stage import Next
from hivenet_router.pipeline.ticket import Ticket
from hivenet_router.policy.document import Policy


class ResponseCache:
    name = "cache"

    def __init__(
        self,
        policy_for: Callable[[str], Policy],
        clock: Clock,
        valkey: Any = None,
        prefix: str = "",
    ) -> None:
        self.policy_for = policy_for
        self.clock = clock
        self.valkey = valkey  # the site store's client (--sync-store=valkey), or None
        self.prefix = prefix  # the site's key prefix

    async def __call__(self, ticket: Ticket, next: Next) -> Answer:
        return await next(ticket)
