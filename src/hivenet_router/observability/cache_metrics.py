"""The response cache (gateway/cache.py) as metrics, read at scrape time."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from prometheus_client.core import Metric

from hivenet_router.observability.layer_metrics import (
    SnapshotCollector,
    counter,
    counters,
    counts_by,
    gauge,
)

RESULTS = ("hit", "miss", "dedup", "bypass")


@dataclass(frozen=True, slots=True)
class CacheSnapshot:
    results: dict[str, int]  # requests by result: hit, miss, dedup, bypass
    entries: int  # answers stored in this router's memory
    bytes: int  # their size, overhead included
    evictions: int  # entries pushed out by the bounds (expiries not counted)
    flights: int  # answers in flight that identical requests can join
    store_errors: dict[str, int] = field(default_factory=dict)  # site store failures by kind


class CacheCollector(SnapshotCollector[CacheSnapshot]):
    def families(self, now: CacheSnapshot) -> Iterable[Metric]:
        yield counters(
            "hivenet_cache_requests",
            "Requests of a model whose policy has a response cache, by what the cache did",
            ("result",),
            (((result,), now.results.get(result, 0)) for result in RESULTS),
        )
        yield gauge("hivenet_cache_entries", "Answers stored in this router's memory", now.entries)
        yield gauge(
            "hivenet_cache_bytes", "Bytes of the answers stored in this router's memory", now.bytes
        )
        yield counter(
            "hivenet_cache_evictions",
            "Stored answers pushed out by the entry or byte bound",
            now.evictions,
        )
        yield gauge(
            "hivenet_cache_flights", "Answers in flight that identical requests share", now.flights
        )
        yield counts_by(
            "hivenet_cache_store_errors",
            "Failed calls to the site store by the response cache, by kind",
            "kind",
            now.store_errors,
        )
