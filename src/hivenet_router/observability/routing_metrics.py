"""Routing's learnt state as metrics, read at scrape time: circuit breakers, adaptive
concurrency limits and the prefix indexes' size. Labels are agents' peer IDs, provider
names and model names the router registered, never a client's value."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

# Gauge values of hivenet_circuit_breaker_state.
STATE_VALUES = {"closed": 0, "half_open": 1, "open": 2}

BreakerRows = Callable[[], Iterable[tuple[str, str, str, dict[str, int]]]]
Pairs = Callable[[], Iterable[tuple[str, int]]]


class RoutingCollector(Collector):
    def __init__(self, breakers: BreakerRows, limits: Pairs, prefixes: Pairs) -> None:
        self._breakers = breakers  # (kind, target, state, transitions by state entered)
        self._limits = limits  # (peer ID, adaptive limit)
        self._prefixes = prefixes  # (model, blocks indexed)

    def collect(self) -> Iterable[Metric]:
        labels = ["kind", "target"]
        state = GaugeMetricFamily(
            "hivenet_circuit_breaker_state",
            "Circuit breaker state: 0 closed, 1 half-open, 2 open",
            labels=labels,
        )
        entered = CounterMetricFamily(
            "hivenet_circuit_breaker_transitions",
            "Times a circuit breaker entered a state",
            labels=[*labels, "state"],
        )
        for kind, target, now, transitions in self._breakers():
            state.add_metric([kind, target], STATE_VALUES[now])
            for name, count in transitions.items():
                entered.add_metric([kind, target, name], count)
        limit = GaugeMetricFamily(
            "hivenet_agent_concurrency_limit",
            "Adaptive (Vegas) concurrency limit of an agent",
            labels=["peer_id"],
        )
        for peer, value in self._limits():
            limit.add_metric([peer], value)
        blocks = GaugeMetricFamily(
            "hivenet_prefix_index_blocks",
            "Prompt-prefix blocks the affinity index holds for a model, over all agents",
            labels=["model"],
        )
        for model, value in self._prefixes():
            blocks.add_metric([model], value)
        yield from (state, entered, limit, blocks)
