"""Dynamic gates: an agent whose live signal crosses a threshold leaves the step."""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass

from hivenet_router.policy.signals import SIGNALS, AgentFacts

OPERATORS: dict[str, Callable[[float, float], bool]] = {
    "gt": operator.gt,
    "gte": operator.ge,
    "lt": operator.lt,
    "lte": operator.le,
}


@dataclass(frozen=True, slots=True)
class ThresholdGate:
    signal: str
    op: str
    threshold: float

    def excludes(self, agent: AgentFacts) -> bool:
        value = SIGNALS[self.signal](agent)
        return value is not None and OPERATORS[self.op](value, self.threshold)

    def describe(self) -> str:
        return f"{self.signal} {self.op} {self.threshold:g}"
