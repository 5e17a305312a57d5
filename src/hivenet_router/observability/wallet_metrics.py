"""The wallets' ledger (--ledger-dsn) as metrics, read at scrape time.

Counts are kept by the ledger and the wallet stage as plain numbers; this collector only
formats them when Prometheus asks. Nothing here names the database (its DSN is a secret).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


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


def _counter(name: str, doc: str, label: str, values: dict[str, int]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=[label])
    for key, count in sorted(values.items()):
        family.add_metric([key], count)
    return family


class WalletCollector(Collector):
    def __init__(self, snapshot: Callable[[], WalletSnapshot]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterable[Metric]:
        now = self._snapshot()
        yield GaugeMetricFamily(
            "hivenet_ledger_up", "1 when the wallet ledger (PostgreSQL) answers", value=now.up
        )
        yield GaugeMetricFamily(
            "hivenet_wallet_pending_charges",
            "Charges kept on local disk until the ledger can take them",
            value=now.pending,
        )
        yield GaugeMetricFamily(
            "hivenet_wallet_dead_charges",
            "Charges the ledger refused for their own data: kept on local disk, never retried",
            value=now.dead,
        )
        yield CounterMetricFamily(
            "hivenet_wallet_lost_charges",
            "Charges neither billed nor kept on disk (the disk refused them at shutdown)",
            value=now.lost,
        )
        yield CounterMetricFamily(
            "hivenet_wallet_unbilled",
            "Requests let through without a balance check while the ledger was unreachable",
            value=now.unbilled,
        )
        yield CounterMetricFamily(
            "hivenet_wallet_charges", "Charges written to the ledger", value=now.charges
        )
        yield CounterMetricFamily(
            "hivenet_wallet_holds_expired",
            "Holds released because their request never settled (its router died)",
            value=now.holds_expired,
        )
        yield _counter(
            "hivenet_wallet_refused",
            "Requests refused by the wallet stage, by reason",
            "reason",
            now.refused,
        )
        yield _counter("hivenet_ledger_errors", "Failed ledger calls, by kind", "kind", now.errors)
