"""Counters and histograms for one event loop, exposed to Prometheus at scrape time.

prometheus_client guards every increment with a lock and resolves labels through a
dictionary of child objects; on the request path, which runs on one thread, neither is
needed. These keep plain numbers in a dict keyed by label values and hand Prometheus the
same families when it scrapes.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

# OpenTelemetry's HTTP server buckets, then on to 30 minutes: an LLM answer often takes
# longer than their last, 10 s, where every slower one read 10 s.
DEFAULT_BUCKETS = (
    *(0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0),
    *(30.0, 60.0, 120.0, 300.0, 600.0, 1800.0),
)


class CounterSeries:
    """A counter family: `name` without its `_total` suffix, as Prometheus families go."""

    __slots__ = ("help", "labels", "name", "values")

    def __init__(self, name: str, help: str, labels: Sequence[str]) -> None:
        self.name = name.removesuffix("_total")
        self.help = help
        self.labels = list(labels)
        # per label set, a one-item list: a caller that counts the same labels often may
        # keep the list (see `cell`) and add to it without a lookup
        self.values: dict[tuple[str, ...], list[float]] = {}

    def inc(self, labels: tuple[str, ...], amount: float = 1.0) -> None:
        self.cell(labels)[0] += amount

    def cell(self, labels: tuple[str, ...]) -> list[float]:
        """The label set's value as a one-item list (the series shows it from now on)."""
        cell = self.values.get(labels)
        if cell is None:
            cell = self.values[labels] = [0.0]
        return cell

    def family(self) -> Metric:
        out = CounterMetricFamily(self.name, self.help, labels=self.labels)
        for labels, cell in list(self.values.items()):
            out.add_metric(list(labels), cell[0])
        return out


class HistogramSeries:
    __slots__ = ("bounds", "help", "labels", "name", "values")

    def __init__(
        self, name: str, help: str, labels: Sequence[str], bounds: Sequence[float] = DEFAULT_BUCKETS
    ) -> None:
        self.name = name
        self.help = help
        self.labels = list(labels)
        self.bounds = tuple(bounds)
        # per label set: a count per bucket (the last is +Inf), then the sum
        self.values: dict[tuple[str, ...], list[float]] = {}

    def observe(self, labels: tuple[str, ...], value: float) -> None:
        counts = self.cell(labels)
        counts[bisect.bisect_left(self.bounds, value)] += 1
        counts[-1] += value

    def cell(self, labels: tuple[str, ...]) -> list[float]:
        """The label set's counts: one per bucket (`bisect_left(bounds, value)` is a
        value's), then the sum. The series shows the label set from now on."""
        counts = self.values.get(labels)
        if counts is None:
            counts = self.values[labels] = [0.0] * (len(self.bounds) + 2)
        return counts

    def family(self) -> Metric:
        out = HistogramMetricFamily(self.name, self.help, labels=self.labels)
        for labels, counts in list(self.values.items()):
            running = 0.0
            buckets = []
            for bound, count in zip((*self.bounds, float("inf")), counts[:-1], strict=True):
                running += count
                buckets.append(("+Inf" if bound == float("inf") else repr(bound), running))
            out.add_metric(list(labels), buckets, counts[-1])
        return out


class SeriesCollector(Collector):
    """Hands every family to Prometheus when it scrapes."""

    def __init__(self, series: Iterable[CounterSeries | HistogramSeries]) -> None:
        self._series = list(series)

    def collect(self) -> Iterable[Metric]:
        for series in self._series:
            yield series.family()
