"""Strategies by name, and the options a policy step may give them.

A step names its strategy (`strategy: prefix-affinity`) and may tune it with one block of
options (`affinity:`, `hash:` or `scoring:`); `build` turns the two into the Strategy the
executor runs, once, when the policy is read.

    least-loaded     the most free share of its slots (the reference's only strategy)
    round-robin      whoever was chosen least recently among the free candidates
    power-of-two     the less loaded of two candidates drawn at random
    lowest-srtt      the smallest smoothed time to the answer's head
    consistent-hash  a session key (or the prompt's first block) to the same agent, loads bounded
    prefix-affinity  the agent holding the longest prefix of the prompt, load-guarded
    scored           a weighted sum of scorers, with presets and an optional softmax draw
    predicted-latency  the least predicted time to the first token, ties to the most cached
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hivenet_router.policy.plugins import (
    AffinityPicker,
    AffinityScorer,
    BestPicker,
    CostScorer,
    EvenScorer,
    HashPicker,
    HealthScorer,
    LatencyScorer,
    LoadScorer,
    Picker,
    PowerOfTwoPicker,
    RelativeLoadScorer,
    Scorer,
    SoftmaxPicker,
    Strategy,
)
from hivenet_router.policy.predicted import PredictedLatencyPicker, PredictedLatencyScorer
from hivenet_router.policy.signals import AgentFacts

NAMES = (
    "least-loaded",
    "round-robin",
    "power-of-two",
    "lowest-srtt",
    "consistent-hash",
    "prefix-affinity",
    "scored",
    "predicted-latency",
)
SCORERS = ("load", "latency", "cost", "affinity", "breaker", "ttft")
PRESETS: dict[str, dict[str, float]] = {
    # Weights per scorer. The latency scorer measures the time to an answer's head, which
    # for a stream includes prefill: affinity lowers it too, so latency-first also leans on
    # the cache.
    "latency-first": {"latency": 0.35, "load": 0.35, "affinity": 0.2, "breaker": 0.1},
    "cost-first": {"cost": 0.6, "load": 0.2, "latency": 0.1, "breaker": 0.1},
    "load-balanced": {"load": 0.7, "latency": 0.1, "affinity": 0.1, "breaker": 0.1},
    "speculative": {"affinity": 0.4, "latency": 0.3, "load": 0.2, "breaker": 0.1},
}
# The speculative preset draws instead of taking the best, so that every candidate keeps
# getting a little traffic and a faster one is found.
PRESET_TEMPERATURE = {"speculative": 0.2}


@dataclass(frozen=True, slots=True)
class CostRule:
    fields: tuple[tuple[str, str], ...]
    tags: tuple[str, ...]
    usd_per_million_tokens: float

    def matches(self, agent: AgentFacts) -> bool:
        reg = agent.reg
        return all(getattr(reg, name) == wanted for name, wanted in self.fields) and all(
            tag in reg.tags for tag in self.tags
        )


@dataclass(frozen=True, slots=True)
class Options:
    """A step's strategy options; each strategy reads only its own."""

    # prefix-affinity
    min_match: float = 0.1
    max_imbalance: int = 8
    # consistent-hash
    hash_key: str = "session"  # "session" (a request header) or "prefix"
    hash_header: str = "x-session-id"
    load_factor: float = 1.25
    # scored
    preset: str = "load-balanced"
    weights: tuple[tuple[str, float], ...] = ()  # overrides of the preset's weights
    temperature: float | None = None
    costs: tuple[CostRule, ...] = ()
    # predicted-latency (max_imbalance is shared with prefix-affinity)
    ttft_objective_ms: float | None = None

    def scored_weights(self) -> dict[str, float]:
        weights = dict.fromkeys(SCORERS, 0.0)
        weights.update(PRESETS[self.preset])
        weights.update(dict(self.weights))
        return weights


def _price(rules: tuple[CostRule, ...]) -> Callable[[AgentFacts], float]:
    def price(agent: AgentFacts) -> float:
        for rule in rules:
            if rule.matches(agent):
                return rule.usd_per_million_tokens
        return 0.0

    return price


def build(name: str, options: Options) -> Strategy:
    """The Strategy a step runs. `name` is one of NAMES (the parser checked it)."""
    load: Scorer = LoadScorer()
    best: Picker = BestPicker()
    if name == "least-loaded":
        return Strategy(((load, 1.0),), BestPicker(warm=True))
    if name == "round-robin":
        return Strategy(((EvenScorer(), 1.0),), best)
    if name == "power-of-two":
        return Strategy(((load, 1.0),), PowerOfTwoPicker())
    if name == "lowest-srtt":
        return Strategy(((LatencyScorer(), 1.0),), best)
    if name == "consistent-hash":
        # The session header is read by dispatch into the routing input (RouteInput.session).
        picker = HashPicker(options.hash_key == "prefix", options.load_factor)
        return Strategy(((load, 1.0),), picker, uses_prefix=options.hash_key == "prefix")
    if name == "prefix-affinity":
        affinity = AffinityPicker(options.min_match, options.max_imbalance)
        return Strategy(((load, 1.0),), affinity, uses_prefix=True)
    if name == "predicted-latency":
        objective = options.ttft_objective_ms
        predicted = PredictedLatencyPicker(
            options.max_imbalance, None if objective is None else objective / 1000
        )
        return Strategy(((EvenScorer(), 1.0),), predicted, uses_prefix=True, predicts=True)
    return _scored(options)


def _scored(options: Options) -> Strategy:
    weights = options.scored_weights()
    scorers: dict[str, Scorer] = {
        "load": RelativeLoadScorer(),
        "latency": LatencyScorer(),
        "cost": CostScorer(_price(options.costs)),
        "affinity": AffinityScorer(),
        "breaker": HealthScorer(),
        "ttft": PredictedLatencyScorer(),
    }
    chosen = tuple((scorers[name], weight) for name, weight in weights.items() if weight > 0)
    temperature = options.temperature
    if temperature is None:
        temperature = PRESET_TEMPERATURE.get(options.preset)
    picker: Picker = BestPicker() if temperature is None else SoftmaxPicker(temperature)
    predicts = weights["ttft"] > 0
    return Strategy(
        chosen, picker, uses_prefix=weights["affinity"] > 0 or predicts, predicts=predicts
    )
