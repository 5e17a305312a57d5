"""Routing plug-ins: Filters drop agents, Scorers rank them, a Picker chooses one.

Each is given the request's facts, so a plug-in can route by what is asked (a prefix, a
size) and not only by who is free. They are pure: they read agents and return, and they
are registered by name here, to be chosen from policy YAML (`strategy: least-loaded`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from hivenet_router.domain.request import RequestFacts
from hivenet_router.policy.gates import ThresholdGate
from hivenet_router.policy.signals import AgentFacts

A = TypeVar("A", bound=AgentFacts)


class Filter(Protocol):
    def filter(self, facts: RequestFacts, agents: Sequence[A]) -> Sequence[A]: ...


class Scorer(Protocol):
    def score(self, facts: RequestFacts, agents: Sequence[A]) -> Sequence[float]:
        """One score per agent, from 0 (worst) to 1 (best)."""
        ...


class Picker(Protocol):
    def pick(self, agents: Sequence[A], scores: Sequence[float]) -> A | None: ...


@dataclass(frozen=True, slots=True)
class GateFilter:
    """A step's `exclude_if`: an agent whose live signal crosses any threshold leaves."""

    gates: tuple[ThresholdGate, ...]

    def filter(self, facts: RequestFacts, agents: Sequence[A]) -> Sequence[A]:
        gates = self.gates
        return [a for a in agents if not any(g.excludes(a) for g in gates)]


class LoadScorer:
    """Free share of declared capacity: 1 for an idle agent, 0 for a full one."""

    def score(self, facts: RequestFacts, agents: Sequence[A]) -> Sequence[float]:
        return [1.0 - agent.active / agent.reg.capacity for agent in agents]


class BestPicker:
    """The highest score; ties go to the agent chosen least recently."""

    def pick(self, agents: Sequence[A], scores: Sequence[float]) -> A | None:
        best: A | None = None
        best_key = (0.0, 0)
        for agent, score in zip(agents, scores, strict=True):
            key = (-score, agent.last_assigned)
            if best is None or key < best_key:
                best, best_key = agent, key
        return best


@dataclass(frozen=True, slots=True)
class Strategy:
    """How a step ranks its candidates: weighted scorers and a picker."""

    scorers: tuple[tuple[Scorer, float], ...]
    picker: Picker


STRATEGIES: dict[str, Strategy] = {
    "least-loaded": Strategy(((LoadScorer(), 1.0),), BestPicker()),
}
