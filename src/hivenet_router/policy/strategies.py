"""Ranking strategies, registered by name in one place and chosen from policy YAML."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar

from hivenet_router.policy.signals import AgentFacts

A = TypeVar("A", bound=AgentFacts)


class Strategy(Protocol):
    def pick(self, candidates: Sequence[A]) -> A | None:
        """The best candidate with a free slot, or None when all are full."""
        ...


class LeastLoaded:
    """Lowest active requests / declared capacity; ties go to the least recently chosen."""

    def pick(self, candidates: Sequence[A]) -> A | None:
        best: A | None = None
        best_key: tuple[float, int] = (0.0, 0)
        for agent in candidates:
            if agent.active >= agent.reg.capacity:
                continue
            key = (agent.active / agent.reg.capacity, getattr(agent, "last_assigned", 0))
            if best is None or key < best_key:
                best, best_key = agent, key
        return best


STRATEGIES: dict[str, Strategy] = {
    "least-loaded": LeastLoaded(),
}
