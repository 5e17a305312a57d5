"""What one agent's engine takes to answer's first token, learnt from traffic.

A stream's time to its first chunk, as the router measures it, is modelled as

    ttft = wait for a slot + base + prefill_rate * uncached prompt tokens

where `base` holds everything that does not grow with the prompt (the network, the agent,
the engine's scheduling step) and the uncached tokens are the prompt's estimate less the
prefix the router expected the engine to hold. Each agent keeps its last WINDOW
observations of (uncached tokens, ttft less the predicted wait) and fits the line through
them by Theil-Sen: the slope is the median of the slopes between pairs of observations
whose token counts differ enough to tell, the intercept the median of what is left. A
median ignores any minority of the window, so one outlier (a stalled request, a cache
miss the index did not foresee) barely moves either figure, and once more than half of the
window comes from an engine that changed speed, the figures are the new engine's: the fit
follows a slowed engine within WINDOW observations, whatever came before. Sooner, in
fact: CHANGE_RUN observations in a row off the fit on one side (by more than CHANGE_SHARE)
mean the engine changed, and the window keeps only them. An engine that changed while it
got no traffic (slow, so not chosen; then recovered) is caught by staleness: figures no
observation confirmed for STALE_S are shown as not measured, the agent is tried again, and
an observation then off the fit starts the window afresh.

While the window holds too few observations to tell the slope from the intercept (all
prompts of one length, say), the slope stays at its last value or the cold-start prior:
the engine's own prompt throughput where it reports one, else PRIOR_PREFILL_S.

The time a request holds an engine slot (until its answer closes) is smoothed separately,
with each sample clipped to a few times the current figure so a single hung stream cannot
make the engine look busy for long; with the engine's batch size (learnt from its
running count whenever it reports requests waiting) it prices a wait in the engine's queue.

Pure and synchronous; the caller supplies every observation and the clock's readings.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

__all__ = [
    "MIN_SAMPLES",
    "PRIOR_BASE_S",
    "PRIOR_PREFILL_S",
    "STALE_S",
    "WINDOW",
    "Learner",
    "Rates",
    "median",
]

WINDOW = 24
"""Observations a fit looks at: it follows a changed engine within this many."""

MIN_SAMPLES = 4
"""Observations before an agent's own fit is believed; until then it is a cold agent."""

MIN_SPREAD_TOKENS = 32
"""Two observations tell the prefill rate apart from the base only when their uncached
token counts differ by at least this much (half a prefix block)."""

PRIOR_BASE_S = 0.02
PRIOR_PREFILL_S = 0.0001
"""Cold-start figures: 20 ms to the first token, 10,000 prompt tokens a second."""

CHANGE_RUN = 6
CHANGE_SHARE = 0.25
"""An engine that changed speed: CHANGE_RUN observations in a row off the fit by more than
CHANGE_SHARE of its prediction, all on the same side. The window then keeps only those,
so the fit follows within CHANGE_RUN observations rather than half a window; one outlier,
or noise on both sides, never starts it."""

STALE_S = 10.0
STALE_FASTER = 0.1
"""Figures no observation has confirmed for this long are stale: an engine that was slow
gets no traffic, so nothing would ever show that it recovered. Routing state shows a stale
agent's figures as not measured (it is tried again, as a new agent is), and the first
observation after that which is off the fit (by more than CHANGE_SHARE) starts the window
afresh. An agent is stale because it looked slow, so on that first observation a time
more than STALE_FASTER under the fit counts as off too."""

SERVICE_SMOOTHING = 0.2
SERVICE_CLIP = 4.0
"""A service-time sample moves the smoothed figure by SERVICE_SMOOTHING of its distance,
after being clipped to within SERVICE_CLIP times (or a SERVICE_CLIP-th of) the figure."""


def median(values: list[float]) -> float:
    """The median of a non-empty list (it is sorted in place)."""
    values.sort()
    middle = len(values) // 2
    if len(values) % 2:
        return values[middle]
    return (values[middle - 1] + values[middle]) / 2


@dataclass(frozen=True, slots=True)
class Rates:
    """One agent's learnt figures, as a prediction reads them."""

    base_s: float = PRIOR_BASE_S
    prefill_s: float = PRIOR_PREFILL_S  # seconds per uncached prompt token
    service_s: float | None = None  # seconds a request holds an engine slot; None: unknown
    slots: int | None = None  # the engine's batch size, when it was seen full
    samples: int = 0  # observations behind base_s and prefill_s

    @property
    def cold(self) -> bool:
        return self.samples < MIN_SAMPLES


class Learner:
    """One agent's observations and the figures fitted to them."""

    __slots__ = (
        "_at",
        "_borrowed",
        "_fitted",
        "_points",
        "_prior",
        "_rates",
        "_service",
        "_slots",
        "_streak",
        "probed",
    )

    def __init__(self, prior_prefill_s: float | None = None) -> None:
        self._points: deque[tuple[float, float]] = deque(maxlen=WINDOW)
        self._at = 0.0  # the clock's reading at the last observation
        self.probed = -STALE_S  # when routing last sent it a request while it was stale
        self._prior = prior_prefill_s if prior_prefill_s and prior_prefill_s > 0 else None
        self._fitted: float | None = None  # the last slope its own observations gave
        self._borrowed: float | None = None  # the fleet's best slope, while it has none
        self._service: float | None = None
        self._slots: int | None = None
        self._streak = 0  # observations in a row far off the fit, signed by their side
        self._rates = Rates(prefill_s=self._prior or PRIOR_PREFILL_S)

    @property
    def rates(self) -> Rates:
        return self._rates

    def prior(self, prefill_s: float | None) -> None:
        """The engine's own prompt throughput, as seconds per token: the slope used while
        the observations cannot tell it (ignored when not a positive number)."""
        if prefill_s is None or not prefill_s > 0 or prefill_s == self._prior:
            return
        self._prior = prefill_s
        if not self._spread():
            self._refit()

    @property
    def sloped(self) -> bool:
        """Has its own window told its prefill rate (observations far enough apart)?"""
        return self._spread()

    def borrow(self, prefill_s: float | None) -> None:
        """The fastest prefill rate measured on the fleet, for the slope while neither its
        own observations nor its engine have told it (the prior of 100 us a token made an
        agent measured on short prompts alone lose every long one, and so never be
        measured on one). None: nothing to borrow."""
        if prefill_s == self._borrowed or (prefill_s is not None and not prefill_s >= 0):
            return
        self._borrowed = prefill_s
        if not self._spread():
            self._refit()

    def stale(self, now: float) -> bool:
        """Measured, but not confirmed by an observation for STALE_S seconds."""
        return not self._rates.cold and now - self._at > STALE_S

    def due(self, now: float) -> bool:
        """Stale, and not tried again within STALE_S (a try whose answer was no stream
        confirms nothing: the next waits its turn)."""
        return self.stale(now) and now - self.probed > STALE_S

    def observe(self, uncached_tokens: float, ttft_s: float, now: float = 0.0) -> None:
        """A stream's first chunk after `ttft_s` seconds (less the wait it was predicted to
        queue), for a prompt of `uncached_tokens` the engine was not expected to hold, at
        `now` on the caller's clock. Nonsense (negative, not finite) is ignored."""
        if not (ttft_s >= 0 and uncached_tokens >= 0) or ttft_s == float("inf"):
            return
        if uncached_tokens == float("inf"):
            return
        if self.stale(now) and self._off(uncached_tokens, ttft_s, STALE_FASTER):
            self._points.clear()  # not what the old figures say: they are no longer true
            self._fitted = None  # nor is the slope they gave
            self._streak = 0
        self._at = now
        self._follow(uncached_tokens, ttft_s)
        self._points.append((uncached_tokens, ttft_s))
        self._refit()

    def _off(self, tokens: float, ttft_s: float, faster: float = CHANGE_SHARE) -> bool:
        """Off the fit: slower by more than CHANGE_SHARE, or faster by more than `faster`,
        of the prediction."""
        rates = self._rates
        predicted = rates.base_s + rates.prefill_s * tokens
        return ttft_s > (1 + CHANGE_SHARE) * predicted or ttft_s < (1 - faster) * predicted

    def _follow(self, tokens: float, ttft_s: float) -> None:
        """Count observations far off the fit on one side; at CHANGE_RUN, forget the
        window before them."""
        rates = self._rates
        if rates.cold:
            return
        predicted = rates.base_s + rates.prefill_s * tokens
        off = ttft_s - predicted
        side = 0 if abs(off) <= CHANGE_SHARE * predicted else (1 if off > 0 else -1)
        streak = self._streak
        streak = streak + side if side and (streak == 0 or (streak > 0) == (side > 0)) else side
        if abs(streak) >= CHANGE_RUN:
            points = self._points
            for _ in range(len(points) - (CHANGE_RUN - 1)):
                points.popleft()
            streak = 0
        self._streak = streak

    def served(self, hold_s: float) -> None:
        """A request held a slot of the engine for `hold_s` seconds, to its answer's end."""
        if not hold_s >= 0 or hold_s == float("inf"):
            return
        current = self._service
        if current is None:
            current = hold_s
        else:
            low, high = current / SERVICE_CLIP, current * SERVICE_CLIP
            clipped = min(max(hold_s, low), high)
            current += SERVICE_SMOOTHING * (clipped - current)
        self._service = current
        self._rates = _with(self._rates, service_s=current)

    def engine_load(self, running: float | None, waiting: float | None) -> None:
        """The engine's reported counts: requests waiting beside `running` ones mean the
        engine runs no more than that many at once."""
        if running is None or waiting is None or waiting <= 0 or running < 1:
            return
        slots = int(running)
        if slots != self._slots:
            self._slots = slots
            self._rates = _with(self._rates, slots=slots)

    def _spread(self) -> bool:
        points = self._points
        if len(points) < 2:
            return False
        tokens = [u for u, _ in points]
        return max(tokens) - min(tokens) >= MIN_SPREAD_TOKENS

    def _refit(self) -> None:
        points = list(self._points)
        slope = self._slope(points)
        if slope is not None:
            self._fitted = slope
        elif self._prior is not None:
            slope = self._prior
        elif self._fitted is not None:
            slope = self._fitted
        else:
            slope = self._borrowed if self._borrowed is not None else PRIOR_PREFILL_S
        base = max(0.0, median([y - slope * u for u, y in points])) if points else PRIOR_BASE_S
        self._rates = Rates(base, slope, self._service, self._slots, len(points))

    @staticmethod
    def _slope(points: list[tuple[float, float]]) -> float | None:
        slopes: list[float] = []
        for index, (u1, y1) in enumerate(points):
            for u2, y2 in points[index + 1 :]:
                spread = u2 - u1
                if spread >= MIN_SPREAD_TOKENS or spread <= -MIN_SPREAD_TOKENS:
                    slopes.append((y2 - y1) / spread)
        if not slopes:
            return None
        return max(0.0, median(slopes))


def _with(rates: Rates, *, service_s: float | None = None, slots: int | None = None) -> Rates:
    return Rates(
        rates.base_s,
        rates.prefill_s,
        service_s if service_s is not None else rates.service_s,
        slots if slots is not None else rates.slots,
        rates.samples,
    )
