"""One shape for a layer's metrics, read at scrape time.

A layer keeps its counts as plain numbers and hands its collector one function that
returns them (its snapshot); the collector turns one snapshot into families when
Prometheus scrapes. The request path pays nothing for it, and a new layer writes only its
snapshot and its `families`. The helpers below build the families these collectors share:
one value, or rows of label values.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Generic, TypeVar

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

S = TypeVar("S")

Rows = Iterable[tuple[Sequence[str], float]]


class SnapshotCollector(Collector, Generic[S]):
    """Takes the layer's snapshot once per scrape and yields `families(snapshot)`."""

    def __init__(self, snapshot: Callable[[], S]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterable[Metric]:
        yield from self.families(self._snapshot())

    def families(self, now: S) -> Iterable[Metric]:
        raise NotImplementedError


def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def gauges(name: str, doc: str, labels: Sequence[str], rows: Rows) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=list(labels))
    for values, value in rows:
        family.add_metric(list(values), value)
    return family


def counters(name: str, doc: str, labels: Sequence[str], rows: Rows) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=list(labels))
    for values, value in rows:
        family.add_metric(list(values), value)
    return family


def counts_by(name: str, doc: str, label: str, counts: Mapping[str, float]) -> CounterMetricFamily:
    """A counter by one label, its series in the label's order."""
    return counters(name, doc, (label,), (((key,), n) for key, n in sorted(counts.items())))
