"""The site sync (--sync-store=valkey) as metrics, read at scrape time."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from prometheus_client.core import HistogramMetricFamily, Metric

from hivenet_router.observability.layer_metrics import (
    SnapshotCollector,
    counter,
    counts_by,
    gauge,
    gauges,
)


@dataclass(frozen=True, slots=True)
class SyncSnapshot:
    peers: int  # other live routers
    min_routers: int
    store_up: bool  # the last round succeeded
    settling: bool
    lag: float  # seconds since the last good round (since start when none yet)
    bounds: tuple[float, ...]  # round-duration bucket bounds
    durations: tuple[int, ...]  # counts per bucket, the last one above every bound
    duration_sum: float
    errors: dict[str, int] = field(default_factory=dict)
    grants: dict[str, int] = field(default_factory=dict)
    acks: dict[str, int] = field(default_factory=dict)
    held: tuple[tuple[str, int], ...] = ()  # (model, credits held)
    given_up: int = 0
    store_losses: int = 0


class SyncCollector(SnapshotCollector[SyncSnapshot]):
    def families(self, now: SyncSnapshot) -> Iterable[Metric]:
        yield gauge("hivenet_sync_peers", "Other routers of the site seen live", now.peers)
        yield gauge(
            "hivenet_sync_min_routers", "--sync-min-routers of this router", now.min_routers
        )
        yield gauge(
            "hivenet_sync_store_up", "1 when the last sync round reached the store", now.store_up
        )
        yield gauge(
            "hivenet_sync_settling", "1 during the settle window after a store loss", now.settling
        )
        yield gauge("hivenet_sync_lag_seconds", "Seconds since the last good sync round", now.lag)
        yield _rounds(now)
        yield counts_by(
            "hivenet_sync_store_errors", "Failed store calls by kind", "kind", now.errors
        )
        yield counts_by(
            "hivenet_sync_grants", "Occupancy credit grants by result", "result", now.grants
        )
        yield counts_by(
            "hivenet_sync_grant_acks", "Grants a replica acknowledged or not", "result", now.acks
        )
        yield gauges(
            "hivenet_sync_held_credits",
            "Occupancy credits (tokens) this router holds for a model",
            ("model",),
            (((model,), value) for model, value in now.held),
        )
        yield counter(
            "hivenet_sync_given_up", "Times the other routers gave this one up", now.given_up
        )
        yield counter(
            "hivenet_sync_store_losses",
            "Times the store was found to have lost its data",
            now.store_losses,
        )


def _rounds(now: SyncSnapshot) -> HistogramMetricFamily:
    cumulative, buckets = 0, []
    for bound, count in zip((*now.bounds, float("inf")), now.durations, strict=True):
        cumulative += count
        buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
    return HistogramMetricFamily(
        "hivenet_sync_round_duration_seconds",
        "Duration of one sync round with the store",
        buckets=buckets,
        sum_value=now.duration_sum,
    )
