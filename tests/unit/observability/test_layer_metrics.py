"""The shape every layer's collector shares: one snapshot per scrape, families from it."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric

from hivenet_router.observability.layer_metrics import (
    SnapshotCollector,
    counter,
    counts_by,
    gauge,
    gauges,
)


class _Collector(SnapshotCollector[dict[str, int]]):
    def families(self, now: dict[str, int]) -> Iterable[Metric]:
        yield gauge("test_size", "Entries", len(now))
        yield counter("test_total_seen", "Seen", sum(now.values()))
        yield counts_by("test_by_kind", "By kind", "kind", now)
        yield gauges("test_rows", "Rows", ("a", "b"), [(("x", "y"), 2.5)])


def test_one_snapshot_per_scrape_and_rows_in_label_order() -> None:
    taken: list[int] = []

    def snapshot() -> dict[str, int]:
        taken.append(1)
        return {"zeta": 1, "alpha": 2}

    registry = CollectorRegistry()
    registry.register(_Collector(snapshot))
    before = len(taken)
    text = generate_latest(registry).decode()
    assert len(taken) == before + 1
    assert "test_size 2.0" in text
    assert "test_total_seen_total 3.0" in text
    assert text.index('test_by_kind_total{kind="alpha"} 2.0') < text.index(
        'test_by_kind_total{kind="zeta"} 1.0'
    )
    assert 'test_rows{a="x",b="y"} 2.5' in text
