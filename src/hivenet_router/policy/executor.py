"""One policy step over the candidates handed to it: pure, so it is tested without a
registry, a clock or a network.

Candidates are filtered in the documented order (the agents given are those registered
for the model): health, capability, the step's static match, agents that already failed
this request in this step, the circuit breaker, usable slots (the declared capacity, or
the adaptive limit below it), then the step's dynamic filters (its gates); the survivors
are scored and one is picked. When none survives and some candidate is busy, the step is
"full": the request waits for a slot rather than moving on. Taking the chosen agent's
slot is the caller's job, in the same synchronous step.
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
        # Worth waiting whenever a candidate is busy (the spec's capacity gate comes before
        # the thresholds: busy agents are waited for whatever they would show then, and
        # the gates are asked again when a slot frees). A free agent the gates keep out
        # must not turn "wait for the busy ones" into "nobody here".
        return Choice(None, full=any(a.active >= a.limit for a in pool))
    return Choice(step.plan.choose(inp, free))
