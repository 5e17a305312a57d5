"""The wallet stage: 402 at or below zero, a hold at admission, a settle at the end (stub)."""

from __future__ import annotations

from collections.abc import Callable

from hivenet_router.domain.answer import Answer
from hivenet_router.gateway.ledger import Ledger
from hivenet_router.pipeline.stage import Next
from hivenet_router.pipeline.ticket import Ticket
from hivenet_router.policy.document import Policy


class WalletStage:
    name = "wallet"

    def __init__(self, ledger: Ledger, policy_for: Callable[[str], Policy]) -> None:
        self.ledger = ledger
        self.policy_for = policy_for

    async def __call__(self, ticket: Ticket, next: Next) -> Answer:
        return await next(ticket)
