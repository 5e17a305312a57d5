"""Routing plug-ins: Filters drop agents, Scorers rank them, a Picker chooses one.

Each is given the request's routing input (its facts, its prompt's prefix blocks, a session
key, the time), so a plug-in can route by what is asked and not only by who is free. They
read agents and return; whatever they learn from a choice is recorded by the caller
(dispatch), so a plug-in never changes state behind the executor's back. Strategies
(policy/strategies.py) combine them by name, as policy YAML asks (`strategy: scored`).
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, TypeVar

from hivenet_router.domain.request import RequestFacts
from hivenet_router.policy.gates import ThresholdGate
from hivenet_router.policy.signals import AgentFacts
from hivenet_router.routing.prefix import PrefixIndex, prompt_blocks
from hivenet_router.routing.ttft import Rates

if TYPE_CHECKING:
    from hivenet_router.policy.predicted import Forecast

A = TypeVar("A", bound=AgentFacts)


def _healthy(peer: str) -> float:
    return 1.0


_COLD = Rates()


def _cold(peer: str) -> Rates:
    return _COLD


@dataclass(slots=True)
class RouteInput:
    """One request as routing sees it. Built once per request by dispatch; what is costly
    to compute (the prompt's prefix blocks, the affinity matches) is computed on first use
    and kept for the request's retries and re-queues."""

    facts: RequestFacts
    now: float = 0.0
    session: str | None = None  # a client-chosen key that keeps a conversation together
    affinity: PrefixIndex | None = None  # the model's index of prefixes sent to agents
    rng: random.Random = field(default_factory=random.Random)
    # 1 for an agent whose breaker is closed and whose recent requests succeeded, towards
    # 0 for one that fails or is probing in half-open.
    health: Callable[[str], float] = _healthy
    # What routing state learnt of each agent's time to the first token (by peer ID).
    rates: Callable[[str], Rates] = _cold
    # The predicted-latency plug-ins' predictions at the last pick, for routing state to
    # compare the chosen agent's with the answer's measured time.
    forecast: Forecast | None = None
    _blocks: tuple[int, ...] | None = None
    # The last match, with the candidates it was computed for: retries, re-queues and
    # fallback steps ask again about other agents.
    _matched: tuple[tuple[str, ...], dict[str, int]] | None = None

    def blocks(self) -> tuple[int, ...]:
        if self._blocks is None:
            self._blocks = prompt_blocks(self.facts.prompt)
        return self._blocks

    def matches(self, agents: Sequence[AgentFacts]) -> dict[str, int]:
        """Leading prompt blocks each agent was already sent (its likely cache hits)."""
        return self.matches_of(tuple(a.peer_id for a in agents))

    def matches_of(self, peers: tuple[str, ...]) -> dict[str, int]:
        """`matches` for the agents of these peer IDs, for a caller that has them already."""
        matched = self._matched
        if matched is None or matched[0] != peers:
            blocks = self.blocks()
            index = self.affinity
            found = index.match(blocks, peers) if index and blocks else {}
            self._matched = matched = (peers, found)
        return matched[1]

    def affinity_of(self, agents: Sequence[AgentFacts]) -> list[float]:
        """Share of the prompt's blocks each agent holds, 0 to 1."""
        blocks = len(self.blocks())
        if not blocks:
            return [0.0] * len(agents)
        found = self.matches(agents)
        return [found.get(a.peer_id, 0) / blocks for a in agents]


class Filter(Protocol):
    def filter(self, inp: RouteInput, agents: Sequence[A]) -> Sequence[A]: ...


class Scorer(Protocol):
    def score(self, inp: RouteInput, agents: Sequence[A]) -> Sequence[float]:
        """One score per agent, from 0 (worst) to 1 (best)."""
        ...


class Picker(Protocol):
    def pick(self, inp: RouteInput, agents: Sequence[A], scores: Sequence[float]) -> A | None: ...


@dataclass(frozen=True, slots=True)
class GateFilter:
    """A step's `exclude_if`: an agent whose live signal crosses any threshold leaves."""

    gates: tuple[ThresholdGate, ...]

    def filter(self, inp: RouteInput, agents: Sequence[A]) -> Sequence[A]:
        gates = self.gates
        return [a for a in agents if not any(g.excludes(a) for g in gates)]


# -- scorers ------------------------------------------------------------------------------


class LoadScorer:
    """Free share of the agent's usable slots: 1 for an idle agent, 0 for a full one."""

    def score(self, inp: RouteInput, agents: Sequence[A]) -> Sequence[float]:
        return [1.0 - agent.active / agent.limit for agent in agents]


class RelativeLoadScorer:
    """Load against the least busy candidate: 1 for it, (1 + least) / (1 + active) for the
    others. Unlike the free share of slots, it still tells agents apart when their declared
    capacity is far above what their engine can run at once."""

    def score(self, inp: RouteInput, agents: Sequence[A]) -> Sequence[float]:
        least = min((a.active for a in agents), default=0)
        return [(1 + least) / (1 + a.active) for a in agents]


class EvenScorer:
    """Every agent the same: the picker's tie-break (least recently chosen) decides, which
    is round robin over whoever is free."""

    def score(self, inp: RouteInput, agents: Sequence[A]) -> Sequence[float]:
        return [1.0] * len(agents)


# Successes before an agent's SRTT is believed. Its first answers carry cold-start costs
# (a new engine connection, an empty cache); judged on them alone, an agent that is never
# chosen again would never be measured again.
MEASURED_AFTER = 8


def _measured(agent: AgentFacts) -> float | None:
    srtt = agent.srtt_ms
    if srtt is None or srtt <= 0 or agent.successes < MEASURED_AFTER:
        return None
    return srtt


class LatencyScorer:
    """Smoothed round-trip time relative to the fastest candidate: 1 for the fastest. An
    agent not yet measured (fewer than MEASURED_AFTER successes) scores as the fastest, so
    it gets tried."""

    def score(self, inp: RouteInput, agents: Sequence[A]) -> Sequence[float]:
        srtts = [_measured(a) for a in agents]
        known = [s for s in srtts if s is not None]
        if not known:
            return [1.0] * len(agents)
        best = min(known)
        return [1.0 if s is None else best / s for s in srtts]


@dataclass(frozen=True, slots=True)
class CostScorer:
    """Cheaper per token scores higher: 1 for the cheapest candidate, 0 for the dearest.
    Prices come from the policy (`scoring.costs`); an agent no rule matches costs 0."""

    prices: Callable[[AgentFacts], float]

    def score(self, inp: RouteInput, agents: Sequence[A]) -> Sequence[float]:
        costs = [self.prices(a) for a in agents]
        top = max(costs, default=0.0)
        if top <= 0:
            return [1.0] * len(agents)
        return [1.0 - cost / top for cost in costs]


class AffinityScorer:
    """Share of the prompt's leading blocks the agent was already sent."""

    def score(self, inp: RouteInput, agents: Sequence[A]) -> Sequence[float]:
        return inp.affinity_of(agents)


class HealthScorer:
    """Breaker state and recent success: 1 healthy, towards 0 failing or half-open."""

    def score(self, inp: RouteInput, agents: Sequence[A]) -> Sequence[float]:
        health = inp.health
        return [health(a.peer_id) for a in agents]


# -- pickers ------------------------------------------------------------------------------


def _better(
    agent: AgentFacts, score: float, best: AgentFacts | None, best_score: float, warm: bool = False
) -> bool:
    if best is None:
        return True
    if score != best_score:
        return score > best_score
    if warm:
        return agent.last_served > best.last_served
    return agent.last_assigned < best.last_assigned


@dataclass(frozen=True, slots=True)
class BestPicker:
    """The highest score. Ties go to the agent chosen least recently, which spreads work
    evenly; with `warm`, to the one that most recently served a request well, which keeps
    light traffic on an agent that is already awake (its process, its caches, its engine's
    prefix cache) and leaves the others idle until load tells them apart. A failure makes
    an agent the last of its equals."""

    warm: bool = False

    def pick(self, inp: RouteInput, agents: Sequence[A], scores: Sequence[float]) -> A | None:
        best: A | None = None
        best_score = 0.0
        warm = self.warm
        for agent, score in zip(agents, scores, strict=True):
            if _better(agent, score, best, best_score, warm):
                best, best_score = agent, score
        return best


class PowerOfTwoPicker:
    """Two candidates drawn at random; the better of the two. Spreads load nearly as well
    as looking at everyone, without every router herding onto the same least-loaded agent."""

    def pick(self, inp: RouteInput, agents: Sequence[A], scores: Sequence[float]) -> A | None:
        if len(agents) <= 2:
            return BestPicker().pick(inp, agents, scores)
        first, second = inp.rng.sample(range(len(agents)), 2)
        a, b = agents[first], agents[second]
        return a if _better(a, scores[first], b, scores[second]) else b


@dataclass(frozen=True, slots=True)
class SoftmaxPicker:
    """A draw with probability growing as exp(score / temperature): near the best at a low
    temperature, near uniform at a high one. Keeps some traffic on every candidate, so a
    recovered or newly fast agent is noticed."""

    temperature: float

    def pick(self, inp: RouteInput, agents: Sequence[A], scores: Sequence[float]) -> A | None:
        if not agents:
            return None
        top = max(scores)
        weights = [math.exp((s - top) / self.temperature) for s in scores]
        return inp.rng.choices(agents, weights)[0]


@dataclass(frozen=True, slots=True)
class AffinityPicker:
    """The agent holding the longest share of the prompt's prefix, unless that would pile
    work on it: an agent more than `max_imbalance` requests busier than the least busy
    candidate is passed over, and load decides (the load guard). Below `min_match` nobody
    holds enough of the prefix to matter, and the load scores decide (least-loaded)."""

    min_match: float
    max_imbalance: int

    def pick(self, inp: RouteInput, agents: Sequence[A], scores: Sequence[float]) -> A | None:
        if not agents:
            return None
        shares = inp.affinity_of(agents)
        least = min(a.active for a in agents)
        best: A | None = None
        best_key = (0.0, 0.0)
        for agent, share, load in zip(agents, shares, scores, strict=True):
            if share < self.min_match or agent.active > least + self.max_imbalance:
                continue
            key = (share, load)
            if best is None or key > best_key:
                best, best_key = agent, key
        if best is not None:
            return best
        return _fresh(inp, agents, scores)


def _fresh(inp: RouteInput, agents: Sequence[A], scores: Sequence[float]) -> A | None:
    """A prefix nobody holds, so its whole prompt is prefilled: the agent expected to
    answer soonest, its pace times the requests it would then carry. Expectations within
    a quarter of the fastest pace of each other count as equal (measured paces of alike
    engines never match exactly), and then the agent with the most free room in its
    prefix cache takes it, so new prefixes land where they will stay."""
    index = inp.affinity
    paces = _paces(agents)
    known = [p for p in paces if p is not None]
    fastest = min(known) if known else 1.0
    step = fastest / 4 or 1.0
    best: A | None = None
    best_key = (0, 0, 0)
    for agent, pace in zip(agents, paces, strict=True):
        room = index.room(agent.peer_id) if index is not None else 0
        expected = (pace or fastest) * (agent.active + 1)
        key = (math.floor(expected / step), -room, agent.last_assigned)
        if best is None or key < best_key:
            best, best_key = agent, key
    return best


def _paces(agents: Sequence[AgentFacts]) -> list[float | None]:
    """How fast each agent's engine works, lower is faster: the engines' own mean time per
    output token when every candidate reports one, else each agent's smoothed time to an
    answer's head. The engine's figure comes first because the SRTT mixes cache hits in:
    the engine that was given the cache misses looks slow for it. None when unknown (the
    agent then counts as the fastest, so it gets tried)."""
    itls = [a.engine.avg_itl_seconds if a.engine is not None else None for a in agents]
    if all(itls):
        return list(itls)
    return [a.srtt_ms if a.srtt_ms is not None and a.srtt_ms > 0 else None for a in agents]


@dataclass(frozen=True, slots=True)
class HashPicker:
    """Consistent hashing with bounded loads: the same key goes to the same agent while the
    fleet stays the same, no agent takes more than `load_factor` times the average load,
    and when an agent leaves only its keys move. Rendezvous hashing ranks the agents for
    the key; the first whose load is within the bound takes it."""

    by_prefix: bool
    load_factor: float

    def key(self, inp: RouteInput) -> bytes | None:
        if not self.by_prefix and inp.session:
            return inp.session.encode()
        blocks = inp.blocks()
        return blocks[0].to_bytes(8, "big", signed=True) if blocks else None

    def pick(self, inp: RouteInput, agents: Sequence[A], scores: Sequence[float]) -> A | None:
        key = self.key(inp)
        if key is None or not agents:
            return BestPicker().pick(inp, agents, scores)
        total = sum(a.active for a in agents) + 1
        bound = math.ceil(self.load_factor * total / len(agents))
        ranked = sorted(agents, key=lambda a: _rendezvous(key, a.peer_id), reverse=True)
        for agent in ranked:
            if agent.active < bound:
                return agent
        return ranked[0]


def _rendezvous(key: bytes, peer: str) -> int:
    # A keyed hash that is the same in every router process (Python's hash() is not), so
    # routers of one site send a key to the same agent.
    digest = hashlib.blake2b(key, digest_size=8, key=peer.encode()[:64]).digest()
    return int.from_bytes(digest, "big")


@dataclass(frozen=True, slots=True)
class Strategy:
    """How a step ranks its candidates: weighted scorers and a picker."""

    scorers: tuple[tuple[Scorer, float], ...]
    picker: Picker
    uses_prefix: bool = False  # dispatch records the prefixes this strategy routes by
    predicts: bool = False  # routing state learns each agent's time to the first token

    def choose(self, inp: RouteInput, agents: Sequence[A]) -> A | None:
        if len(self.scorers) == 1:
            scorer, _ = self.scorers[0]
            scores = scorer.score(inp, agents)
        else:
            totals = [0.0] * len(agents)
            for scorer, weight in self.scorers:
                if weight:
                    for index, value in enumerate(scorer.score(inp, agents)):
                        totals[index] += weight * value
            scores = totals
        return self.picker.pick(inp, agents, scores)
