"""Lock-free counters and histograms as Prometheus reads them."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from hivenet_router.observability.series import CounterSeries, HistogramSeries, SeriesCollector
from tests.procs import metric


def page(*series: CounterSeries | HistogramSeries) -> str:
    registry = CollectorRegistry()
    registry.register(SeriesCollector(series))
    return generate_latest(registry).decode()


def test_counters_add_per_label_set() -> None:
    counter = CounterSeries("x_requests_total", "requests", ["model"])
    counter.inc(("a",))
    counter.inc(("a",), 2)
    counter.inc(("b",))
    text = page(counter)
    assert "# TYPE x_requests_total counter" in text
    assert metric(text, "x_requests_total", model="a") == 3
    assert metric(text, "x_requests_total", model="b") == 1
    assert metric(text, "x_requests_total", model="c") is None


def test_histogram_buckets_are_cumulative_and_inclusive() -> None:
    histogram = HistogramSeries("x_seconds", "time", ["status"], bounds=(0.1, 1.0))
    for value in (0.05, 0.1, 0.5, 3.0):
        histogram.observe(("200",), value)
    text = page(histogram)
    assert metric(text, "x_seconds_bucket", status="200", le="0.1") == 2
    assert metric(text, "x_seconds_bucket", status="200", le="1.0") == 3
    assert metric(text, "x_seconds_bucket", status="200", le="+Inf") == 4
    assert metric(text, "x_seconds_count", status="200") == 4
    assert abs((metric(text, "x_seconds_sum", status="200") or 0) - 3.65) < 1e-9
