"""The predicted-latency plug-ins: each candidate's time to the first token, predicted.

    predicted = wait for a slot + base + prefill rate x (prompt tokens - cached tokens)

The prompt's tokens are estimated from its text (four characters a token), the cached
tokens from the prefix index (the leading blocks the agent holds, 64 tokens each), and the
agent's base, prefill rate, service time and batch size are what routing state learnt from
its earlier answers (routing/ttft.py), handed in through `RouteInput.rates`. The wait is
the requests ahead of this one in the engine's queue (what it reports waiting, or the
router's own requests beyond its batch size) times its service time over its batch size.

An agent not measured yet (fewer than MIN_SAMPLES answers) is predicted with the fastest
measured candidate's figures, so it is tried and measured rather than starved. Everything
here reads and returns; what the prediction was for the chosen agent is kept on the input
for routing state to learn from when the answer comes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hivenet_router.policy.plugins import A, RouteInput
from hivenet_router.policy.signals import AgentFacts
from hivenet_router.routing.prefix import BLOCK_CHARS
from hivenet_router.routing.ttft import Rates

CHARS_PER_TOKEN = 4
TOKENS_PER_BLOCK = BLOCK_CHARS / CHARS_PER_TOKEN
# Predictions within this much of the least are equal, and cache then decides: measured
# figures of alike engines never match exactly.
TIE_SHARE = 0.05
TIE_SECONDS = 0.001
# The prompt by which cold agents' stand-in figures are chosen (the fastest on it).
TYPICAL_TOKENS = 256
# Uncached tokens up to which an agent not measured yet wins a tie (it is measured on
# cheap prompts; on a longer one a measured agent wins).
EXPLORE_TOKENS = 256


@dataclass(frozen=True, slots=True)
class Prediction:
    seconds: float  # the predicted time to the first token
    wait_s: float  # its part spent waiting for a slot
    prompt_tokens: float  # the prompt's estimate
    cached_tokens: float  # of which the agent is expected to hold
    cold: bool = False  # predicted with another agent's figures: not measured yet


def prompt_tokens(inp: RouteInput) -> float:
    return max(1.0, inp.facts.text_bytes / CHARS_PER_TOKEN)


def wait_s(agent: AgentFacts, rates: Rates) -> float:
    """Seconds the request is expected to queue in the agent's engine before it runs."""
    service = rates.service_s
    if service is None:
        return 0.0
    engine = agent.engine
    queued = 0.0
    running = None
    if engine is not None:
        queued = engine.waiting_requests or 0.0
        running = engine.running_requests
    slots = rates.slots
    if slots:
        queued = max(queued, agent.active + 1 - slots)
    if queued <= 0:
        return 0.0
    width = slots or max(running or 1.0, 1.0)
    return queued * service / width


def predict(agent: AgentFacts, rates: Rates, tokens: float, cached_blocks: int) -> Prediction:
    cached = min(tokens, cached_blocks * TOKENS_PER_BLOCK)
    wait = wait_s(agent, rates)
    seconds = wait + rates.base_s + rates.prefill_s * (tokens - cached)
    return Prediction(seconds, wait, tokens, cached, rates.cold)


def _warm(agents: Sequence[AgentFacts], rates: list[Rates]) -> list[Rates]:
    """Cold agents' figures replaced by the fastest measured candidate's (optimism that
    gets them measured); their own service time and batch size stay."""
    measured = [r for r in rates if not r.cold]
    if not measured or len(measured) == len(rates):
        return rates
    fastest = min(measured, key=lambda r: r.base_s + r.prefill_s * TYPICAL_TOKENS)
    return [
        r if not r.cold else Rates(fastest.base_s, fastest.prefill_s, r.service_s, r.slots, 0)
        for r in rates
    ]


def predictions(inp: RouteInput, agents: Sequence[AgentFacts]) -> list[Prediction]:
    """Each agent's predicted time to the first token; kept on `inp` by peer ID, so the
    caller can learn how far off the chosen agent's was."""
    tokens = prompt_tokens(inp)
    found = inp.matches(agents)
    rates = _warm(agents, [inp.rates(a.peer_id) for a in agents])
    out = [
        predict(agent, r, tokens, found.get(agent.peer_id, 0))
        for agent, r in zip(agents, rates, strict=True)
    ]
    inp.predicted.update((a.peer_id, p) for a, p in zip(agents, out, strict=True))
    return out


def _tie_key(agent: AgentFacts, p: Prediction) -> tuple[float, bool, int, int]:
    # A cold agent is tried on cheap prompts only: a long miss would pay its unknown speed.
    costly = p.cold and p.prompt_tokens - p.cached_tokens > EXPLORE_TOKENS
    return (-p.cached_tokens, costly, agent.active, agent.last_assigned)


class PredictedLatencyScorer:
    """1 for the candidate predicted to answer first, least / theirs for the others."""

    def score(self, inp: RouteInput, agents: Sequence[A]) -> Sequence[float]:
        seconds = [p.seconds for p in predictions(inp, agents)]
        least = min(seconds, default=0.0)
        return [1.0 if s <= 0 else (least / s if least > 0 else 0.0) for s in seconds]


@dataclass(frozen=True, slots=True)
class PredictedLatencyPicker:
    """The least predicted time to the first token, among candidates at most
    `max_imbalance` requests busier than the least busy one (the load guard); predictions
    within TIE_SHARE (or TIE_SECONDS) of the least are ties, won by the most cached tokens,
    then (for more than EXPLORE_TOKENS uncached) a measured agent over one not measured
    yet, then the least busy, then the one chosen least recently. With `objective_s`, any
    candidate predicted under it will do, and the one holding the most cache wins (so a
    conversation stays where it is cached while that is fast enough)."""

    max_imbalance: int
    objective_s: float | None = None

    def pick(self, inp: RouteInput, agents: Sequence[A], scores: Sequence[float]) -> A | None:
        if not agents:
            return None
        least = min(a.active for a in agents)
        guarded = [a for a in agents if a.active <= least + self.max_imbalance]
        preds = predictions(inp, guarded)
        pool = list(zip(guarded, preds, strict=True))
        objective = self.objective_s
        if objective is not None:
            under = [(a, p) for a, p in pool if p.seconds <= objective]
            if under:
                return min(under, key=lambda c: (-c[1].cached_tokens, c[1].seconds))[0]
        best = min(p.seconds for p in preds)
        bound = best + max(TIE_SECONDS, best * TIE_SHARE)
        ties = [(a, p) for a, p in pool if p.seconds <= bound]
        return min(ties, key=lambda c: _tie_key(c[0], c[1]))[0]
