"""The stream validator's counts, kept as plain numbers and handed to Prometheus at scrape
time (the stage counts; `ValidatorCollector` reads)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

from prometheus_client.core import Metric

from hivenet_router.observability.layer_metrics import SnapshotCollector
from hivenet_router.observability.series import CounterSeries, HistogramSeries

RESULTS: Final = ("clean", "degenerate", "late_degenerate", "syntax", "late_syntax")
# The syntax checks (gateway/syntax.py CHECKS; observability may not import the gateway).
CHECKS: Final = ("json", "schema", "tool_args", "events")
TARGETS: Final = ("provider", "agent")
# The held window adds up to hold_ms to a stream's first byte: buckets from a few
# milliseconds to the longest sensible window.
HOLD_BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 1.5, 2.5, 5.0)


class ValidatorMetrics:
    """What the stream validator saw: streams by verdict, syntax failures by check,
    fallbacks by target and result, and how long first chunks were held back."""

    __slots__ = ("fallbacks", "hold", "streams", "syntax")

    def __init__(self) -> None:
        self.streams = CounterSeries(
            "hivenet_validator_streams_total",
            "Local answers the stream validator judged, by verdict",
            ("result",),
        )
        self.fallbacks = CounterSeries(
            "hivenet_validator_fallbacks_total",
            "Rejected local answers sent elsewhere, by target and how that went",
            ("to", "result"),
        )
        self.syntax = CounterSeries(
            "hivenet_validator_syntax_failures_total",
            "Local answers rejected for their syntax, by the check that failed",
            ("check",),
        )
        self.hold = HistogramSeries(
            "hivenet_validator_hold_seconds",
            "Time an answer's first chunks were held back before the verdict",
            (),
            HOLD_BUCKETS,
        )
        # Every series exists from the start: a dashboard tells "none yet" from "not
        # scraped", and a rate over a fresh router starts at zero.
        for result in RESULTS:
            self.streams.inc((result,), 0.0)
        for check in CHECKS:
            self.syntax.inc((check,), 0.0)
        for target in TARGETS:
            for outcome in ("ok", "error"):
                self.fallbacks.inc((target, outcome), 0.0)
        self.hold.values[()] = [0.0] * (len(HOLD_BUCKETS) + 2)

    def judged(self, result: str, check: str | None = None) -> None:
        self.streams.inc((result,))
        if check is not None:
            self.syntax.inc((check,))

    def fell_back(self, target: str, ok: bool) -> None:
        self.fallbacks.inc((target, "ok" if ok else "error"))

    def held(self, seconds: float) -> None:
        self.hold.observe((), seconds)


class ValidatorCollector(SnapshotCollector[ValidatorMetrics]):
    """The stage counts into series as it goes (the counts are its snapshot), so a
    scrape hands them over as they stand."""

    def __init__(self, metrics: ValidatorMetrics) -> None:
        super().__init__(lambda: metrics)

    def families(self, now: ValidatorMetrics) -> Iterable[Metric]:
        yield now.streams.family()
        yield now.fallbacks.family()
        yield now.syntax.family()
        yield now.hold.family()
