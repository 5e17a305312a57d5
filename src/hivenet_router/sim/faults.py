"""Fault injection for the simulator, set by flag at start and changed by admin call."""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class Faults:
    error_rate: float = 0.0
    latency: float = 0.0
    hang_rate: float = 0.0
    stall_rate: float = 0.0
    repeat_rate: float = 0.0
    crash_after: int = 0

    def update(self, changes: dict[str, Any]) -> None:
        """Apply a partial update; raises ValueError naming the bad field."""
        for name, value in changes.items():
            if name not in self.__dataclass_fields__:
                raise ValueError(f"unknown fault {name!r}")
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"fault {name!r} must be a number")
            if name.endswith("_rate") and not 0.0 <= value <= 1.0:
                raise ValueError(f"fault {name!r} must be between 0 and 1")
            if value < 0:
                raise ValueError(f"fault {name!r} must not be negative")
            setattr(self, name, int(value) if name == "crash_after" else float(value))

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class Draw:
    """The faults that apply to one request, drawn once when it arrives."""

    error: bool
    hang: bool
    stall: bool
    repeat: bool


class FaultDice:
    def __init__(self, faults: Faults, seed: int) -> None:
        self.faults = faults
        self._rng = random.Random(seed ^ 0x5EED)

    def draw(self) -> Draw:
        f = self.faults
        if not (f.error_rate or f.hang_rate or f.stall_rate or f.repeat_rate):
            return _CLEAN
        rng = self._rng
        return Draw(
            error=rng.random() < f.error_rate,
            hang=rng.random() < f.hang_rate,
            stall=rng.random() < f.stall_rate,
            repeat=rng.random() < f.repeat_rate,
        )


_CLEAN = Draw(error=False, hang=False, stall=False, repeat=False)
