"""One policy step over the candidates handed to it: pure, so it is tested without a
registry, a clock or a network.

Candidates are filtered in the documented order (the agents given are those registered
for the model): health, capability, the step's static match, agents that already failed
this request in this step, the circuit breaker, usable slots (the declared capacity, or
the adaptive limit below it), then the step's dynamic filters (its gates); the survivors
are scored and one is picked. When none survives and a busy candidate would pass the
gates, the step is "full": the request waits for a slot rather than moving on. Taking
the chosen agent's slot is the caller's job, in the same synchronous step.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Generic

from hivenet_router.policy.document import Step
from hivenet_router.policy.plugins import A, GateFilter, RouteInput
from hivenet_router.policy.signals import AgentFacts


@dataclass(frozen=True, slots=True)
class Choice(Generic[A]):
    """The agent to try, or why there is none: `full` when the step has candidates that
    are all at capacity (worth waiting for), else the step has nobody for this request."""

    agent: A | None
    full: bool = False


def _everyone(agent: AgentFacts) -> bool:
    return True


def run_step(
    step: Step,
    inp: RouteInput,
    agents: Sequence[A],
    failed: Collection[str],
    admits: Callable[[AgentFacts], bool] = _everyone,
) -> Choice[A]:
    """`admits` is the circuit breakers' say: False for an agent whose breaker is open (or
    half-open with its probes out)."""
    facts = inp.facts
    match = step.match
    pool = [
        agent
        for agent in agents
        if agent.eligible
        and agent.reg.capability == facts.capability
        and match.accepts(agent)
        and agent.peer_id not in failed
        and admits(agent)
    ]
    if not pool:
        return Choice(None)
    free: Sequence[A] = [agent for agent in pool if agent.active < agent.limit]
    if step.gates and free:
        free = GateFilter(step.gates).filter(inp, free)
    if not free:
        return Choice(None, full=_worth_waiting(step, inp, pool))
    return Choice(step.plan.choose(inp, free))


def _worth_waiting(step: Step, inp: RouteInput, pool: Sequence[A]) -> bool:
    """Is some busy candidate one the gates would let through once a slot frees? Then the
    request waits for it, even while an agent the gates keep out has room. A gate on
    capacity_utilization is left out of the question: it only restates that the agent is
    busy, and a busy agent is what a wait is for."""
    busy = [a for a in pool if a.active >= a.limit]
    if not busy or not step.gates:
        return bool(busy)
    gates = tuple(g for g in step.gates if g.signal != "capacity_utilization")
    return bool(GateFilter(gates).filter(inp, busy)) if gates else True
