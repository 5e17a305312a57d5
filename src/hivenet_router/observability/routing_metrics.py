"""Routing's learnt state as metrics, read at scrape time: circuit breakers, adaptive
concurrency limits and the prefix indexes' size. Labels are agents' peer IDs, provider
names and model names the router registered, never a client's value."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client.core import Metric

from hivenet_router.observability.layer_metrics import SnapshotCollector, counters, gauges

# Gauge values of hivenet_circuit_breaker_state.
STATE_VALUES = {"closed": 0, "half_open": 1, "open": 2}

Breaker = tuple[str, str, str, dict[str, int]]  # kind, target, state, transitions by state
BreakerRows = Callable[[], Iterable[Breaker]]
Pairs = Callable[[], Iterable[tuple[str, int]]]
# Predictions measured, and the median and 90th percentile of their absolute relative error.
Errors = tuple[int, float | None, float | None]


def _no_errors() -> Errors:
    return 0, None, None


@dataclass(frozen=True, slots=True)
class RoutingSnapshot:
    breakers: list[Breaker]
    limits: list[tuple[str, int]]  # (peer ID, adaptive limit)
    prefixes: list[tuple[str, int]]  # (model, blocks indexed)
    errors: Errors = (0, None, None)
    reports: int = 0


class RoutingCollector(SnapshotCollector[RoutingSnapshot]):
    def __init__(
        self,
        breakers: BreakerRows,
        limits: Pairs,
        prefixes: Pairs,
        errors: Callable[[], Errors] = _no_errors,
        reports: Callable[[], int] = lambda: 0,
    ) -> None:
        super().__init__(
            lambda: RoutingSnapshot(
                list(breakers()), list(limits()), list(prefixes()), errors(), reports()
            )
        )

    def families(self, now: RoutingSnapshot) -> Iterable[Metric]:
        yield gauges(
            "hivenet_circuit_breaker_state",
            "Circuit breaker state: 0 closed, 1 half-open, 2 open",
            ("kind", "target"),
            (((kind, target), STATE_VALUES[state]) for kind, target, state, _ in now.breakers),
        )
        yield counters(
            "hivenet_circuit_breaker_transitions",
            "Times a circuit breaker entered a state",
            ("kind", "target", "state"),
            (
                ((kind, target, name), count)
                for kind, target, _, transitions in now.breakers
                for name, count in transitions.items()
            ),
        )
        yield gauges(
            "hivenet_agent_concurrency_limit",
            "Adaptive (Vegas) concurrency limit of an agent",
            ("peer_id",),
            (((peer,), value) for peer, value in now.limits),
        )
        yield gauges(
            "hivenet_prefix_index_blocks",
            "Prompt-prefix blocks the affinity index holds for a model, over all agents",
            ("model",),
            (((model,), value) for model, value in now.prefixes),
        )
        count, p50, p90 = now.errors
        yield counters(
            "hivenet_ttft_predictions",
            "Streams routed by predicted latency whose first chunk was measured against "
            "the prediction",
            (),
            (((), count),),
        )
        yield gauges(
            "hivenet_ttft_prediction_error_ratio",
            "Absolute error of the predicted time to the first token, as a share of the "
            "measured time, over the last 512 predictions (quantile 0.5 and 0.9)",
            ("quantile",),
            (((q,), value) for q, value in (("0.5", p50), ("0.9", p90)) if value is not None),
        )
        yield counters(
            "hivenet_cache_reports",
            "Agents' reports of the prompt-prefix blocks their engines hold, applied to the "
            "prefix indexes",
            (),
            (((), now.reports),),
        )
