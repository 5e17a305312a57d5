"""Circuit breaker for one agent or provider: trip on failures, cool off, probe, close.

Time comes in as `now` (monotonic seconds) and settings come in on every call, so a policy
reload takes effect at the next call and tests never sleep. Every call is O(1) amortised.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final

from hivenet_router.routing.bounds import bound_problem as _bound_problem


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True, slots=True)
class BreakerSettings:
    """When a breaker opens, how long it stays open and how it probes its way back."""

    consecutive_failures: int = 5
    error_rate: float = 0.5
    window: int = 20
    min_requests: int = 10
    open_seconds: float = 10.0
    half_open_probes: int = 2
    enabled: bool = True


# Inclusive bounds a policy parser refuses values outside of; OPEN_BOUNDS marks the ends that
# are themselves refused, and check_settings also holds min_requests to at most `window`.
RANGES: Final[Mapping[str, tuple[float, float]]] = MappingProxyType(
    {
        "consecutive_failures": (0, 1000),
        "error_rate": (0.0, 1.0),
        "window": (2, 10000),
        "min_requests": (1, 10000),
        "open_seconds": (0.0, 3600.0),
        "half_open_probes": (1, 100),
    }
)
OPEN_BOUNDS: Final[Mapping[str, tuple[bool, bool]]] = MappingProxyType(
    {"open_seconds": (True, False)}
)
_INT_FIELDS: Final = frozenset(
    {"consecutive_failures", "window", "min_requests", "half_open_probes"}
)


def check_settings(s: BreakerSettings) -> str | None:
    """The first out-of-range field as `breaker.<field>: <why>`, or None when all are fine."""
    for name, (low, top) in RANGES.items():
        value = getattr(s, name)
        if isinstance(value, bool) or not isinstance(value, int | float):
            return f"breaker.{name}: must be a number"
        if name in _INT_FIELDS and not isinstance(value, int):
            return f"breaker.{name}: must be an integer"
        high = min(top, s.window) if name == "min_requests" else top
        problem = _bound_problem(value, low, high, OPEN_BOUNDS.get(name, (False, False)))
        if problem:
            return f"breaker.{name}: {problem}"
    return None


class Breaker:
    """The breaker of one target. Meant for a single event loop; no locking.

    `started` hands back a ticket (the breaker's phase counter); passing it to `record` lets
    the breaker tell a half-open probe from a request sent before it opened. Without a ticket,
    an outcome seen while half-open is taken as a probe's whenever a probe is in flight.
    """

    __slots__ = (
        "_consecutive",
        "_epoch",
        "_failures",
        "_outcomes",
        "_probe_successes",
        "_probes",
        "_state",
        "opened_at",
        "transitions",
    )

    def __init__(self) -> None:
        self._state = BreakerState.CLOSED
        self.opened_at: float | None = None
        self.transitions: dict[str, int] = {state.value: 0 for state in BreakerState}
        self._outcomes: deque[bool] = deque()  # True marks a failure
        self._failures = 0
        self._consecutive = 0
        self._probes = 0
        self._probe_successes = 0
        self._epoch = 0

    @property
    def failures_in_window(self) -> int:
        return self._failures

    @property
    def outcomes_in_window(self) -> int:
        return len(self._outcomes)

    @property
    def probes_in_flight(self) -> int:
        return self._probes

    def state(self, now: float, s: BreakerSettings) -> BreakerState:
        self._sync(now, s)
        return self._state

    def allows(self, now: float, s: BreakerSettings) -> bool:
        """Whether a request may be sent now; reserves nothing (see `started`)."""
        self._sync(now, s)
        if not s.enabled or self._state is BreakerState.CLOSED:
            return True
        if self._state is BreakerState.OPEN:
            return False
        return self._probes < s.half_open_probes

    def probe_in(self, now: float, s: BreakerSettings) -> float:
        """Seconds until this breaker, open, lets a probe through (0 once it may)."""
        opened = self.opened_at
        return 0.0 if opened is None else max(0.0, opened + s.open_seconds - now)

    def started(self, now: float, s: BreakerSettings) -> int:
        """Note a request sent to the target; returns its ticket for `record`."""
        self._sync(now, s)
        if s.enabled and self._state is BreakerState.HALF_OPEN:
            # Capped so that a caller which skipped `allows` cannot push the count past the
            # limit; that request's outcome then stands in for a probe's.
            self._probes = min(self._probes + 1, s.half_open_probes)
        return self._epoch

    def record(
        self, ok: bool | None, now: float, s: BreakerSettings, ticket: int | None = None
    ) -> BreakerState | None:
        """The outcome of a started request: True success, False failure, None neither.

        Returns the new state when this outcome changed it, else None.
        """
        self._sync(now, s)
        if not s.enabled:
            return None
        if ticket is not None and ticket != self._epoch:
            # Sent in an earlier phase: what it says is about a target we have since judged.
            return None
        before = self._state
        if before is BreakerState.CLOSED:
            self._closed_outcome(ok, now, s)
        elif before is BreakerState.HALF_OPEN:
            self._probe_outcome(ok, now, s, ticketed=ticket is not None)
        return self._state if self._state is not before else None

    def snapshot(self, now: float, s: BreakerSettings) -> dict[str, object]:
        """A JSON-able view for the admin API."""
        state = self.state(now, s)
        outcomes = len(self._outcomes)
        until: float | None = None
        if state is BreakerState.OPEN and self.opened_at is not None:
            until = self.probe_in(now, s)
        return {
            "state": state.value,
            "consecutive_failures": self._consecutive,
            "failures_in_window": self._failures,
            "outcomes_in_window": outcomes,
            "error_rate": self._failures / outcomes if outcomes else 0.0,
            "probes_in_flight": self._probes,
            "probe_successes": self._probe_successes,
            "seconds_until_half_open": until,
            "transitions": dict(self.transitions),
        }

    def _sync(self, now: float, s: BreakerSettings) -> None:
        if self._state is BreakerState.CLOSED and s.enabled:
            # The common case, once or twice per request: nothing can change but the window.
            if len(self._outcomes) > s.window:
                self._trim(s)
            return
        if not s.enabled:
            if self._state is not BreakerState.CLOSED:
                self._enter(BreakerState.CLOSED, now)
            # Nothing is learnt while off, so turning it back on starts from a clean slate.
            self._clear_window()
            return
        self._trim(s)
        # A reload may lower the probe limit below what is already in flight.
        self._probes = min(self._probes, s.half_open_probes)
        if (
            self._state is BreakerState.OPEN
            and self.opened_at is not None
            and now - self.opened_at >= s.open_seconds
        ):
            self._enter(BreakerState.HALF_OPEN, now)

    def _trim(self, s: BreakerSettings) -> None:
        # The window may have shrunk in a reload; the loop runs only then or after an append.
        keep = max(1, s.window)
        while len(self._outcomes) > keep:
            self._failures -= self._outcomes.popleft()

    def _clear_window(self) -> None:
        self._outcomes.clear()
        self._failures = 0
        self._consecutive = 0

    def _enter(self, state: BreakerState, now: float) -> None:
        self._state = state
        self._epoch += 1
        self.transitions[state.value] += 1
        self._probes = 0
        self._probe_successes = 0
        if state is BreakerState.OPEN:
            self.opened_at = now
        elif state is BreakerState.CLOSED:
            self.opened_at = None
            self._clear_window()

    def _closed_outcome(self, ok: bool | None, now: float, s: BreakerSettings) -> None:
        if ok is None:
            return
        self._outcomes.append(not ok)
        self._failures += not ok
        if len(self._outcomes) > s.window:
            self._trim(s)
        if ok:
            self._consecutive = 0
            return
        self._consecutive += 1
        if self._tripped(s):
            self._enter(BreakerState.OPEN, now)

    def _tripped(self, s: BreakerSettings) -> bool:
        if s.consecutive_failures > 0 and self._consecutive >= s.consecutive_failures:
            return True
        outcomes = len(self._outcomes)
        # Held to the window so that a reload with min_requests > window cannot mute the rate.
        needed = max(1, min(s.min_requests, s.window))
        return s.error_rate > 0 and outcomes >= needed and self._failures / outcomes >= s.error_rate

    def _probe_outcome(
        self, ok: bool | None, now: float, s: BreakerSettings, *, ticketed: bool
    ) -> None:
        if not ticketed and self._probes == 0:
            # No probe is out, so this can only be a request sent before the breaker opened.
            return
        self._probes = max(0, self._probes - 1)
        if ok is None:
            return
        if not ok:
            self._enter(BreakerState.OPEN, now)
            return
        self._probe_successes += 1
        if self._probe_successes >= s.half_open_probes:
            self._enter(BreakerState.CLOSED, now)
