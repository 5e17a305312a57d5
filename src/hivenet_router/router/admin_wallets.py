"""Admin routes of the wallets: credit, balance, the ledger's pages (stub)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from hivenet_router.gateway.ledger import Ledger
from hivenet_router.http1.messages import Answer, Request

Handler = Callable[[Request], Awaitable[Answer]]


class WalletApi:
    def __init__(self, ledger: Ledger, body_timeout: float) -> None:
        self.ledger = ledger
        self.body_timeout = body_timeout

    def routes(self) -> list[tuple[str, str, Handler]]:
        return []
