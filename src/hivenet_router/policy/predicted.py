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
from hivenet_router.routing.ttft import MIN_SAMPLES, Rates

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


def _fastest(rates: list[Rates]) -> Rates | None:
    """The measured figures cold agents borrow (optimism that gets them measured): the
    fastest measured candidate's on a typical prompt; None when none is measured."""
    best: Rates | None = None
    best_s = 0.0
    for r in rates:
        if r.samples >= MIN_SAMPLES:
            s = r.base_s + r.prefill_s * TYPICAL_TOKENS
            if best is None or s < best_s:
                best, best_s = r, s
    return best


# (seconds, wait_s, cached tokens, cold): one candidate's prediction, a plain tuple
# because this runs for every candidate of every request.
Row = tuple[float, float, float, bool]


def _rows(inp: RouteInput, agents: Sequence[AgentFacts]) -> list[Row]:
    tokens = prompt_tokens(inp)
    found = inp.matches(agents)
    rates_of = inp.rates
    peers = [a.peer_id for a in agents]
    rates = [rates_of(peer) for peer in peers]
    fastest = _fastest(rates)
    rows: list[Row] = []
    kept = inp.predicted
    for agent, peer, r in zip(agents, peers, rates, strict=True):
        cached = found.get(peer, 0) * TOKENS_PER_BLOCK if found else 0.0
        cached = min(cached, tokens)
        cold = r.samples < MIN_SAMPLES
        figures = fastest if cold and fastest is not None else r
        idle = r.service_s is None or (r.slots is None and agent.engine is None)
        wait = 0.0 if idle else wait_s(agent, r)
        row = (wait + figures.base_s + figures.prefill_s * (tokens - cached), wait, cached, cold)
        rows.append(row)
        kept[peer] = row
    return rows


def prediction_of(inp: RouteInput, peer: str) -> Prediction | None:
    """The last prediction made for `peer` on this input, if one was."""
    row = inp.predicted.get(peer)
    if row is None:
        return None
    seconds, wait, cached, cold = row
    return Prediction(seconds, wait, prompt_tokens(inp), cached, cold)


def predictions(inp: RouteInput, agents: Sequence[AgentFacts]) -> list[Prediction]:
    """Each agent's predicted time to the first token; kept on `inp` by peer ID, so the
    caller can learn how far off the chosen agent's was."""
    tokens = prompt_tokens(inp)
    return [Prediction(r[0], r[1], tokens, r[2], r[3]) for r in _rows(inp, agents)]


class PredictedLatencyScorer:
    """1 for the candidate predicted to answer first, least / theirs for the others."""

    def score(self, inp: RouteInput, agents: Sequence[A]) -> Sequence[float]:
        seconds = [row[0] for row in _rows(inp, agents)]
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
        bound = least + self.max_imbalance
        guarded = [a for a in agents if a.active <= bound]
        rows = _rows(inp, guarded)
        objective = self.objective_s
        if objective is not None:
            under = [(-r[2], r[0], i) for i, r in enumerate(rows) if r[0] <= objective]
            if under:
                return guarded[min(under)[2]]
        best = min(r[0] for r in rows)
        limit = best + max(TIE_SECONDS, best * TIE_SHARE)
        tokens = prompt_tokens(inp)
        chosen: A | None = None
        chosen_key = (0.0, False, 0, 0)
        for agent, (seconds, _, cached, cold) in zip(guarded, rows, strict=True):
            if seconds > limit:
                continue
            # A cold agent is tried on cheap prompts only: a long miss would pay its
            # unknown speed.
            costly = cold and tokens - cached > EXPLORE_TOKENS
            key = (-cached, costly, agent.active, agent.last_assigned)
            if chosen is None or key < chosen_key:
                chosen, chosen_key = agent, key
        return chosen
