"""One policy step over the candidates handed to it: pure, so it is tested without a
registry, a clock or a network.

Candidates are filtered in the documented order (the agents given are those registered
for the model): health, capability, the step's static match, agents that already failed
this request in this step, declared capacity, then the step's dynamic filters (its
gates); the survivors are scored and one is picked. Taking the chosen agent's slot is the
caller's job, in the same synchronous step.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Generic

from hivenet_router.domain.request import RequestFacts
from hivenet_router.policy.document import Step
from hivenet_router.policy.plugins import STRATEGIES, A, GateFilter


@dataclass(frozen=True, slots=True)
class Choice(Generic[A]):
    """The agent to try, or why there is none: `full` when the step has candidates that
    are all at capacity (worth waiting for), else the step has nobody for this request."""

    agent: A | None
    full: bool = False


def run_step(
    step: Step, facts: RequestFacts, agents: Sequence[A], failed: Collection[str]
) -> Choice[A]:
    match = step.match
    pool = [
        agent
        for agent in agents
        if agent.eligible
        and agent.reg.capability == facts.capability
        and match.accepts(agent)
        and agent.peer_id not in failed
    ]
    if not pool:
        return Choice(None)
    free: Sequence[A] = [agent for agent in pool if agent.active < agent.reg.capacity]
    if not free:
        return Choice(None, full=True)
    if step.gates:
        free = GateFilter(step.gates).filter(facts, free)
        if not free:
            return Choice(None)
    strategy = STRATEGIES[step.strategy]
    if len(strategy.scorers) == 1:
        scorer, _ = strategy.scorers[0]
        scores = scorer.score(facts, free)
    else:
        totals = [0.0] * len(free)
        for scorer, weight in strategy.scorers:
            for index, value in enumerate(scorer.score(facts, free)):
                totals[index] += weight * value
        scores = totals
    return Choice(strategy.picker.pick(free, scores))
