"""What a router's sync has done: rounds, their durations, errors and rare events, for the
metrics and GET /admin/sync."""

from __future__ import annotations

from dataclasses import dataclass, field

ROUND_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


@dataclass(slots=True)
class Health:
    rounds: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    durations: list[int] = field(default_factory=lambda: [0] * (len(ROUND_BUCKETS) + 1))
    duration_sum: float = 0.0
    last_ok: float = 0.0  # monotonic time of the last good round (0: never)
    given_up: int = 0
    gave_up_others: int = 0
    store_losses: int = 0

    def observe(self, seconds: float) -> None:
        self.rounds += 1
        self.duration_sum += seconds
        for index, bound in enumerate(ROUND_BUCKETS):
            if seconds <= bound:
                self.durations[index] += 1
                return
        self.durations[-1] += 1

    def error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1
