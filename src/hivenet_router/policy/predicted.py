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

This runs for every candidate of every request, so a pick predicts in one pass over local
names (Forecast), and prices the wait only for candidates that could still be chosen: the
rest of a prediction is a bound under it, and a candidate whose bound is already past the
tie limit cannot win. The decisions and the figures are those of predicting every candidate
in full (tests/unit/policy/test_predicted_reference.py holds the two side by side).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import compress, repeat
from operator import ge

from hivenet_router.policy.plugins import A, RouteInput
from hivenet_router.policy.signals import AgentFacts
from hivenet_router.routing.prefix import BLOCK_CHARS, PREFIX_CHARS
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
# cheap prompts; on a longer one a measured agent wins) ...
EXPLORE_TOKENS = 256
# ... unless it was passed over for this many assignments: where every prompt is longer,
# it would never be measured (a new fast engine starved beside a slow measured one).
EXPLORE_EVERY = 8
# The most of a prompt the prefix index covers: past it, what an agent holds is unknown.
INDEXED_TOKENS = PREFIX_CHARS / CHARS_PER_TOKEN


@dataclass(frozen=True, slots=True)
class Prediction:
    seconds: float  # the predicted time to the first token
    wait_s: float  # its part spent waiting for a slot
    prompt_tokens: float  # the prompt's estimate
    cached_tokens: float  # of which the agent is expected to hold
    cold: bool = False  # predicted with another agent's figures: not measured yet


def uncached_known(prediction: Prediction) -> bool:
    """Is the prediction's uncached share what the engine had to prefill? Not when the
    agent held every block the index covers of a longer prompt: how much of the rest it
    held is unknown (of a long conversation, as a rule all but the last turn), and
    learning from it would make the engine look many times faster than it is."""
    return prediction.cached_tokens < INDEXED_TOKENS or (
        prediction.prompt_tokens <= prediction.cached_tokens
    )


def prompt_tokens(inp: RouteInput) -> float:
    return max(1.0, inp.facts.text_bytes / CHARS_PER_TOKEN)


def wait_s(agent: AgentFacts, rates: Rates) -> float:
    """Seconds the request is expected to queue in the agent's engine before it runs."""
    return _wait(agent, agent.active, rates)


def _wait(agent: AgentFacts, active: int, rates: Rates) -> float:
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
        queued = max(queued, active + 1 - slots)
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


# (seconds, wait_s, cached tokens, cold): one candidate's prediction, a plain tuple.
Row = tuple[float, float, float, bool]


class Forecast:
    """One pick's predictions over its candidates: `seconds`, each candidate's predicted time
    to the first token, and `row` for the rest of one candidate's prediction.

    `seconds` is made in one pass over local names, since it runs for every candidate of
    every request; a candidate's full prediction (`row`) is made again only when asked for
    (the pick's ties, the chosen agent's for routing state). Both are `predict` with the
    wait of `wait_s`, the same figures added in the same order, so they agree to the last
    bit. Candidates not measured yet borrow the fastest measured one's figures, so they are
    predicted after the others.

    With `prune`, `seconds` need only be right where it matters to a pick: each candidate
    first gets a bound, its prediction less the wait for a slot (the least the prediction
    can be: the wait is never negative, and adding it cannot round the sum below the
    bound), and one whose bound is over the tie limit of the least prediction so far (or
    over `objective_s`, whichever is more) keeps the bound, its wait never priced: it can
    be neither the least, nor a tie, nor under the objective.

    The candidates' peer IDs, loads and learnt figures are read once, at the pick; a row
    asked for later reads the engine's counts then."""

    __slots__ = (
        "_agents",
        "_found",
        "_rows",
        "actives",
        "fastest",
        "peers",
        "rates",
        "seconds",
        "tokens",
    )

    def __init__(
        self,
        inp: RouteInput,
        agents: Sequence[AgentFacts],
        peers: tuple[str, ...],
        actives: list[int],
        prune: bool = False,
        objective_s: float | None = None,
    ) -> None:
        self._agents = agents
        self.peers = peers
        self.actives = actives
        self.tokens = tokens = prompt_tokens(inp)
        self._found = found = inp.matches_of(peers)
        self.rates = rates = list(map(inp.rates, peers))
        self._rows: dict[int, Row] = {}
        self.fastest: Rates | None = None
        held = found.get
        per_block = TOKENS_PER_BLOCK
        least = limit = math.inf
        seconds: list[float] = []
        append = seconds.append
        cold: list[int] = []
        for agent, peer, active, r in zip(agents, peers, actives, rates, strict=True):
            if r.samples < MIN_SAMPLES:
                cold.append(len(seconds))
                append(math.inf)
                continue
            base = r.base_s
            blocks = held(peer, 0)
            if blocks:
                cached = min(blocks * per_block, tokens)
                uncached = r.prefill_s * (tokens - cached)
            else:
                uncached = r.prefill_s * tokens  # tokens - 0.0 is tokens
            bound = base + uncached
            if bound > limit:
                append(bound)
                continue
            wait = 0.0
            service = r.service_s
            if service is not None:
                slots = r.slots
                engine = agent.engine
                if engine is not None:
                    queued = engine.waiting_requests or 0.0
                    if slots:
                        ahead = active + 1 - slots
                        if ahead > queued:  # noqa: PLR1730 (max() would be a call a candidate)
                            queued = ahead
                    if queued > 0:
                        running = engine.running_requests
                        wait = queued * service / (slots or max(running or 1.0, 1.0))
                elif slots:
                    # No engine report: the router's own requests beyond the batch size.
                    queued = active + 1 - slots
                    if queued > 0:
                        wait = queued * service / slots
            if wait:
                bound = wait + base + uncached
            # else 0.0 + base is base: the bound is the prediction
            append(bound)
            if prune and bound < least:
                least = bound
                limit = _limit(bound)
                if objective_s is not None and objective_s > limit:
                    limit = objective_s
        if cold:
            self.fastest = _fastest(rates)
            for i in cold:
                seconds[i] = self.row(i)[0]
        self.seconds = seconds

    def row(self, i: int) -> Row:
        """Candidate `i`'s prediction, as `predict` makes it."""
        row = self._rows.get(i)
        if row is not None:
            return row
        r = self.rates[i]
        cold = r.samples < MIN_SAMPLES
        fastest = self.fastest
        figures = fastest if cold and fastest is not None else r
        tokens = self.tokens
        cached = min(self._found.get(self.peers[i], 0) * TOKENS_PER_BLOCK, tokens)
        idle = r.service_s is None or (r.slots is None and self._agents[i].engine is None)
        wait = 0.0 if idle else _wait(self._agents[i], self.actives[i], r)
        seconds = wait + figures.base_s + figures.prefill_s * (tokens - cached)
        row = self._rows[i] = (seconds, wait, cached, cold)
        return row

    def rows(self) -> list[Row]:
        return [self.row(i) for i in range(len(self.peers))]


def _limit(best: float) -> float:
    """The most a prediction may be and still tie with `best`, the least."""
    return best + max(TIE_SECONDS, best * TIE_SHARE)


def forecast(inp: RouteInput, agents: Sequence[AgentFacts]) -> Forecast:
    """A forecast over `agents`, kept on `inp` so that the caller can ask what was predicted
    for the agent chosen (`prediction_of`)."""
    made = Forecast(inp, agents, tuple([a.peer_id for a in agents]), [a.active for a in agents])
    inp.forecast = made
    return made


def prediction_of(inp: RouteInput, peer: str) -> Prediction | None:
    """The prediction made for `peer` by the input's last pick, if it was a candidate."""
    made = inp.forecast
    if made is None or peer not in made.peers:
        return None
    seconds, wait, cached, cold = made.row(made.peers.index(peer))
    return Prediction(seconds, wait, made.tokens, cached, cold)


def predictions(inp: RouteInput, agents: Sequence[AgentFacts]) -> list[Prediction]:
    """Each agent's predicted time to the first token; kept on `inp`, so the caller can
    learn how far off the chosen agent's was."""
    made = forecast(inp, agents)
    tokens = made.tokens
    return [Prediction(r[0], r[1], tokens, r[2], r[3]) for r in made.rows()]


class PredictedLatencyScorer:
    """1 for the candidate predicted to answer first, least / theirs for the others."""

    def score(self, inp: RouteInput, agents: Sequence[A]) -> Sequence[float]:
        seconds = forecast(inp, agents).seconds
        least = min(seconds, default=0.0)
        return [1.0 if s <= 0 else (least / s if least > 0 else 0.0) for s in seconds]


@dataclass(frozen=True, slots=True)
class PredictedLatencyPicker:
    """The least predicted time to the first token, among candidates at most
    `max_imbalance` requests busier than the least busy one (the load guard); predictions
    within TIE_SHARE (or TIE_SECONDS) of the least are ties, won by the most cached tokens,
    then (for more than EXPLORE_TOKENS uncached) a measured agent over one not measured
    yet that was assigned a request within the last EXPLORE_EVERY, then the least busy,
    then the one chosen least recently. With `objective_s`, any
    candidate predicted under it will do, and the one holding the most cache wins (so a
    conversation stays where it is cached while that is fast enough).

    Only candidates whose bound (their prediction less the wait) is within the tie limit
    of the candidate with the least bound, or under the objective, are predicted in full:
    no other can be the least, a tie or under the objective."""

    max_imbalance: int
    objective_s: float | None = None

    def pick(self, inp: RouteInput, agents: Sequence[A], scores: Sequence[float]) -> A | None:
        if not agents:
            return None
        peers = tuple([a.peer_id for a in agents])
        actives = [a.active for a in agents]
        bound = min(actives) + self.max_imbalance
        guarded: Sequence[A] = agents
        if max(actives) > bound:
            kept = [i for i, active in enumerate(actives) if active <= bound]
            guarded = [agents[i] for i in kept]
            peers = tuple([peers[i] for i in kept])
            actives = [actives[i] for i in kept]
        objective = self.objective_s
        made = inp.forecast = Forecast(inp, guarded, peers, actives, True, objective)
        seconds = made.seconds
        everyone = range(len(seconds))
        if objective is not None:
            under = [
                (-made.row(i)[2], seconds[i], i)
                for i in compress(everyone, map(ge, repeat(objective), seconds))
            ]
            if under:
                return guarded[min(under)[2]]
        limit = _limit(min(seconds))
        tokens = made.tokens
        chosen: A | None = None
        chosen_key = (0.0, False, 0, 0)
        latest: int | None = None
        # The ties: predictions at most `limit` (few, as a rule).
        for i in compress(everyone, map(ge, repeat(limit), seconds)):
            _, _, cached, cold = made.row(i)
            agent = guarded[i]
            # A cold agent is tried on cheap prompts: a long miss would pay its unknown
            # speed. On a long one too once it was passed over EXPLORE_EVERY times.
            costly = cold and tokens - cached > EXPLORE_TOKENS
            if costly:
                if latest is None:
                    latest = max([a.last_assigned for a in guarded])
                costly = latest - agent.last_assigned < EXPLORE_EVERY
            key = (-cached, costly, actives[i], agent.last_assigned)
            if chosen is None or key < chosen_key:
                chosen, chosen_key = agent, key
        return chosen
