"""Fault injection for the simulator, set by flag at start and changed by admin call."""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Any, Final


@dataclass
class Faults:
    error_rate: float = 0.0
    latency: float = 0.0
    hang_rate: float = 0.0
    stall_rate: float = 0.0
    repeat_rate: float = 0.0
    syntax_rate: float = 0.0  # JSON answers (structured output, tool calls) broken halfway
    crash_after: int = 0
    # Multiplies every delay of the engine model; 1 leaves them as configured. A benchmark
    # raises it mid-run to see whether the router moves traffic off a slowed engine.
    slowdown: float = 1.0

    def update(self, changes: dict[str, Any]) -> None:
        """Apply a partial update; raises ValueError naming the bad field. Every field is
        checked before any is set, so a refused update changes nothing."""
        for name, value in changes.items():
            _check(name, value, self.__dataclass_fields__)
        for name, value in changes.items():
            setattr(self, name, int(value) if name == "crash_after" else float(value))

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _check(name: str, value: Any, fields: dict[str, Any]) -> None:
    if name not in fields:
        raise ValueError(f"unknown fault {name!r}")
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"fault {name!r} must be a number")
    if name.endswith("_rate") and not 0.0 <= value <= 1.0:
        raise ValueError(f"fault {name!r} must be between 0 and 1")
    # Below 1 would make the engine faster than configured, which is no fault.
    if name == "slowdown" and not 1.0 <= value < float("inf"):
        raise ValueError(f"fault {name!r} must be a finite number of at least 1")
    if value < 0:
        raise ValueError(f"fault {name!r} must not be negative")


@dataclass(frozen=True, slots=True)
class Draw:
    """The faults that apply to one request, drawn once when it arrives."""

    error: bool
    hang: bool
    stall: bool
    repeat: bool
    syntax: bool = False


class FaultDice:
    def __init__(self, faults: Faults, seed: int) -> None:
        self.faults = faults
        self._rng = random.Random(seed ^ 0x5EED)

    def draw(self) -> Draw:
        f = self.faults
        if not (f.error_rate or f.hang_rate or f.stall_rate or f.repeat_rate or f.syntax_rate):
            return _CLEAN
        rng = self._rng
        return Draw(
            error=rng.random() < f.error_rate,
            hang=rng.random() < f.hang_rate,
            stall=rng.random() < f.stall_rate,
            repeat=rng.random() < f.repeat_rate,
            # Drawn only when set, so runs seeded before this fault existed draw as they did.
            syntax=rng.random() < f.syntax_rate if f.syntax_rate else False,
        )


_CLEAN = Draw(error=False, hang=False, stall=False, repeat=False)


# What the syntax fault writes into a JSON answer: inside a string an escape JSON does not
# have, outside one a character no JSON value starts with. Either way no continuation can
# make the text valid again, as when a model's constrained decoding slips.
BREAK: Final = "\\q"


def break_json(tokens: list[str]) -> list[str]:
    """A JSON answer's tokens with `BREAK` put in halfway (at a token boundary not right
    after a backslash, which would make it an escaped backslash); the rest follows as it
    was. The answer stays as many tokens long."""
    if not tokens:
        return tokens
    text_before = 0
    half = sum(map(len, tokens)) // 2
    for index, token in enumerate(tokens):
        text_before += len(token)
        if text_before >= half and not token.endswith("\\"):
            out = list(tokens)
            out[index] = token + BREAK
            return out
    return [*tokens[:-1], tokens[-1] + BREAK]
