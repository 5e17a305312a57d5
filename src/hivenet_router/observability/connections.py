"""Each listening port's open connections, its cap and what it refused, for Prometheus.

Read from the ports' guards when scraped, so the request path pays nothing for them."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol

from prometheus_client.core import Metric

from hivenet_router.observability.layer_metrics import SnapshotCollector, counters, gauges


class Guarded(Protocol):
    @property
    def open(self) -> int: ...

    @property
    def total(self) -> int: ...

    @property
    def per_source(self) -> int: ...

    @property
    def refused_total(self) -> int: ...


class ConnectionsCollector(SnapshotCollector[Mapping[str, Guarded]]):
    """`ConnectionsCollector(lambda: guards)`: the guards by port name."""

    def families(self, now: Mapping[str, Guarded]) -> Iterable[Metric]:
        ports = ("port",)
        yield gauges(
            "hivenet_router_connections",
            "Open connections per listening port",
            ports,
            (((name,), guard.open) for name, guard in now.items()),
        )
        yield gauges(
            "hivenet_router_connection_limit",
            "Most connections a listening port holds in all, after fitting the open-files limit",
            ports,
            (((name,), guard.total) for name, guard in now.items()),
        )
        yield gauges(
            "hivenet_router_connection_limit_per_source",
            "Most connections a listening port holds from one IPv4 address or IPv6 /56",
            ports,
            (((name,), guard.per_source) for name, guard in now.items()),
        )
        yield counters(
            "hivenet_router_connections_refused",
            "Connections refused at accept because a cap was reached",
            ports,
            (((name,), guard.refused_total) for name, guard in now.items()),
        )
