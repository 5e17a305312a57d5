"""The wallets' ledger (--ledger-dsn) as metrics, read at scrape time.

Counts are kept by the ledger and the wallet stage as plain numbers; this collector only
formats them when Prometheus asks. Nothing here names the database (its DSN is a secret).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from prometheus_client.core import Metric

from hivenet_router.observability.layer_metrics import (
    SnapshotCollector,
    counter,
    counts_by,
    gauge,
)


@dataclass(frozen=True, slots=True)
class WalletSnapshot:
    up: bool  # the ledger answered its last call
    pending: int  # charges waiting on local disk (or about to be written there)
    unbilled: int  # requests let through without a balance check (fail-open)
    charges: int  # charges the ledger took (from requests and from the pending store)
    holds_expired: int  # holds released because their request never settled
    refused: dict[str, int] = field(default_factory=dict)  # by reason
    errors: dict[str, int] = field(default_factory=dict)  # failed ledger calls by kind
    dead: int = 0  # charges the ledger refused for their own data, kept on disk, not retried
    lost: int = 0  # charges neither billed nor kept (the disk refused them at shutdown)


class WalletCollector(SnapshotCollector[WalletSnapshot]):
    def families(self, now: WalletSnapshot) -> Iterable[Metric]:
        yield gauge("hivenet_ledger_up", "1 when the wallet ledger (PostgreSQL) answers", now.up)
        yield gauge(
            "hivenet_wallet_pending_charges",
            "Charges kept on local disk until the ledger can take them",
            now.pending,
        )
        yield gauge(
            "hivenet_wallet_dead_charges",
            "Charges the ledger refused for their own data: kept on local disk, never retried",
            now.dead,
        )
        yield counter(
            "hivenet_wallet_lost_charges",
            "Charges neither billed nor kept on disk (the disk refused them at shutdown)",
            now.lost,
        )
        yield counter(
            "hivenet_wallet_unbilled",
            "Requests let through without a balance check while the ledger was unreachable",
            now.unbilled,
        )
        yield counter("hivenet_wallet_charges", "Charges written to the ledger", now.charges)
        yield counter(
            "hivenet_wallet_holds_expired",
            "Holds released because their request never settled (its router died)",
            now.holds_expired,
        )
        yield counts_by(
            "hivenet_wallet_refused",
            "Requests refused by the wallet stage, by reason",
            "reason",
            now.refused,
        )
        yield counts_by("hivenet_ledger_errors", "Failed ledger calls, by kind", "kind", now.errors)
