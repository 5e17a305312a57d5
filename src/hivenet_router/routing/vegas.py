"""Adaptive concurrency limit for one agent, in the manner of TCP Vegas.

The queue an agent builds is estimated from how far its smoothed latency sits above its
no-load latency: `queue = limit * (1 - min_latency / latency)`. A short queue lets the limit
grow by one, a long one backs it off multiplicatively. The caller passes capacity and settings
on every call, so a re-registration or a policy reload takes effect at once.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final

from hivenet_router.routing.bounds import bound_problem as _bound_problem
from hivenet_router.routing.bounds import number_text as _num


@dataclass(frozen=True, slots=True)
class VegasSettings:
    """How the limit starts, when it grows or backs off, and how latency is learnt."""

    enabled: bool = False
    initial_limit: int = 4
    alpha: float = 3.0
    beta: float = 6.0
    backoff: float = 0.9
    smoothing: float = 0.2
    rebase_samples: int = 200


# Inclusive bounds a policy parser refuses values outside of; OPEN_BOUNDS marks the ends that
# are themselves refused, and check_settings also requires beta > alpha.
RANGES: Final[Mapping[str, tuple[float, float]]] = MappingProxyType(
    {
        "initial_limit": (1, 100000),
        "alpha": (0.0, 100000.0),
        "beta": (0.0, 100000.0),
        "backoff": (0.0, 1.0),
        "smoothing": (0.0, 1.0),
        "rebase_samples": (10, 1000000),
    }
)
OPEN_BOUNDS: Final[Mapping[str, tuple[bool, bool]]] = MappingProxyType(
    {
        "alpha": (True, False),
        "beta": (True, False),
        "backoff": (True, True),
        "smoothing": (True, False),
    }
)
_INT_FIELDS: Final = frozenset({"initial_limit", "rebase_samples"})
_PREFIX: Final = "adaptive_concurrency"


def check_settings(s: VegasSettings) -> str | None:
    """The first out-of-range field as `adaptive_concurrency.<field>: <why>`, or None."""
    for name, (low, high) in RANGES.items():
        value = getattr(s, name)
        if isinstance(value, bool) or not isinstance(value, int | float):
            return f"{_PREFIX}.{name}: must be a number"
        if name in _INT_FIELDS and not isinstance(value, int):
            return f"{_PREFIX}.{name}: must be an integer"
        problem = _bound_problem(value, low, high, OPEN_BOUNDS.get(name, (False, False)))
        if problem:
            return f"{_PREFIX}.{name}: {problem}"
    if s.beta <= s.alpha:
        return f"{_PREFIX}.beta: must be more than alpha ({_num(s.alpha)})"
    return None


def _clamp(limit: int, capacity: int) -> int:
    # An agent reporting no capacity still gets one slot: a zero limit could never recover.
    return max(1, min(limit, capacity))


class VegasLimiter:
    """The concurrency limit of one agent. Meant for a single event loop; no locking."""

    __slots__ = ("_span_count", "_span_min", "latency", "limit", "min_latency")

    def __init__(self, capacity: int, s: VegasSettings) -> None:
        self.limit = _clamp(s.initial_limit, capacity)
        self.min_latency: float | None = None
        self.latency: float | None = None
        self._span_min = math.inf
        self._span_count = 0

    def queue_estimate(self) -> float | None:
        """Requests estimated to be waiting on the agent, or None before any sample."""
        if self.min_latency is None or self.latency is None:
            return None
        return self.limit * (1.0 - self.min_latency / self.latency)

    def sample(self, latency: float, inflight: int, capacity: int, s: VegasSettings) -> int:
        """Learn from one finished request; returns the new limit.

        `inflight` is how many requests the agent had when this one finished. A latency that
        is not a positive finite number is ignored. While disabled only latency is learnt.
        """
        if math.isfinite(latency) and latency > 0:
            self._learn(latency, s)
            queue = self.queue_estimate()
            if s.enabled and queue is not None:
                # Growing a limit that is not half used would only test capacity nobody asked for.
                if queue < s.alpha and inflight * 2 >= self.limit:
                    self.limit += 1
                elif queue > s.beta:
                    self.limit = math.floor(self.limit * s.backoff)
        self.limit = _clamp(self.limit, capacity)
        return self.limit

    def dropped(self, capacity: int, s: VegasSettings) -> int:
        """A failure or timeout: back off multiplicatively; returns the new limit."""
        if s.enabled:
            self.limit = math.floor(self.limit * s.backoff)
        self.limit = _clamp(self.limit, capacity)
        return self.limit

    def resize(self, capacity: int) -> None:
        """The agent came back with another capacity: keep the limit within it."""
        self.limit = _clamp(self.limit, capacity)

    def snapshot(self) -> dict[str, object]:
        """A JSON-able view for the admin API."""
        return {
            "limit": self.limit,
            "min_latency": self.min_latency,
            "latency": self.latency,
            "queue_estimate": self.queue_estimate(),
            "span_samples": self._span_count,
        }

    def _learn(self, latency: float, s: VegasSettings) -> None:
        if self.latency is None:
            self.latency = latency
        else:
            self.latency += s.smoothing * (latency - self.latency)
        # A faster agent is believed at once; a slower one only after a whole span.
        if self.min_latency is None or latency < self.min_latency:
            self.min_latency = latency
        self._span_min = min(self._span_min, latency)
        self._span_count += 1
        if self._span_count >= s.rebase_samples:
            self.min_latency = self._span_min
            self._span_min = math.inf
            self._span_count = 0
