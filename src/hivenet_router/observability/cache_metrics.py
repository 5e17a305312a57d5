"""The response cache (gateway/cache.py) as metrics, read at scrape time."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

RESULTS = ("hit", "miss", "dedup", "bypass")


@dataclass(frozen=True, slots=True)
class CacheSnapshot:
    results: dict[str, int]  # requests by result: hit, miss, dedup, bypass
    entries: int  # answers stored in this router's memory
    bytes: int  # their size, overhead included
    evictions: int  # entries pushed out by the bounds (expiries not counted)
    flights: int  # answers in flight that identical requests can join
    store_errors: dict[str, int] = field(default_factory=dict)  # site store failures by kind


class CacheCollector(Collector):
    def __init__(self, snapshot: Callable[[], CacheSnapshot]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterable[Metric]:
        now = self._snapshot()
        requests = CounterMetricFamily(
            "hivenet_cache_requests",
            "Requests of a model whose policy has a response cache, by what the cache did",
            labels=["result"],
        )
        for result in RESULTS:
            requests.add_metric([result], now.results.get(result, 0))
        yield requests
        yield GaugeMetricFamily(
            "hivenet_cache_entries", "Answers stored in this router's memory", value=now.entries
        )
        yield GaugeMetricFamily(
            "hivenet_cache_bytes",
            "Bytes of the answers stored in this router's memory",
            value=now.bytes,
        )
        yield CounterMetricFamily(
            "hivenet_cache_evictions",
            "Stored answers pushed out by the entry or byte bound",
            value=now.evictions,
        )
        yield GaugeMetricFamily(
            "hivenet_cache_flights",
            "Answers in flight that identical requests share",
            value=now.flights,
        )
        errors = CounterMetricFamily(
            "hivenet_cache_store_errors",
            "Failed calls to the site store by the response cache, by kind",
            labels=["kind"],
        )
        for kind, count in sorted(now.store_errors.items()):
            errors.add_metric([kind], count)
        yield errors
