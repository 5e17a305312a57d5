"""Tenant wallets in PostgreSQL: balances, holds and an append-only ledger (stub)."""

from __future__ import annotations

from pathlib import Path


class Ledger:
    def __init__(self, dsn: str, pending_dir: Path, timeout: float) -> None:
        self.dsn = dsn
        self.pending_dir = pending_dir
        self.timeout = timeout

    async def run(self) -> None:
        """Connect, apply migrations, bill pending charges; keeps retrying until cancelled."""

    async def close(self) -> None:
        """Keep what is still unbilled on disk and close the pool."""
