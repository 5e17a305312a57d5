"""Each listening port's open connections, its cap and what it refused, for Prometheus.

Read from the ports' guards when scraped, so the request path pays nothing for them."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


class Guarded(Protocol):
    @property
    def open(self) -> int: ...

    @property
    def total(self) -> int: ...

    @property
    def per_source(self) -> int: ...

    @property
    def refused_total(self) -> int: ...


class ConnectionsCollector(Collector):
    def __init__(self, guards: Mapping[str, Guarded]) -> None:
        self._guards = guards

    def collect(self) -> Iterable[Metric]:
        labels = ["port"]
        open_now = GaugeMetricFamily(
            "hivenet_router_connections", "Open connections per listening port", labels=labels
        )
        limit = GaugeMetricFamily(
            "hivenet_router_connection_limit",
            "Most connections a listening port holds in all, after fitting the open-files limit",
            labels=labels,
        )
        per_source = GaugeMetricFamily(
            "hivenet_router_connection_limit_per_source",
            "Most connections a listening port holds from one IPv4 address or IPv6 /56",
            labels=labels,
        )
        refused = CounterMetricFamily(
            "hivenet_router_connections_refused",
            "Connections refused at accept because a cap was reached",
            labels=labels,
        )
        for name, guard in self._guards.items():
            open_now.add_metric([name], guard.open)
            limit.add_metric([name], guard.total)
            per_source.add_metric([name], guard.per_source)
            refused.add_metric([name], guard.refused_total)
        return [open_now, limit, per_source, refused]
