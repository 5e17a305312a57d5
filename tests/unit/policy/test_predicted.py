"""The predicted-latency plug-ins over candidates and learnt figures handed in as data."""

from __future__ import annotations

import random

from hivenet_router.domain.agent import EngineSnapshot
from hivenet_router.domain.request import RequestFacts
from hivenet_router.policy.document import Step, parse_policy
from hivenet_router.policy.executor import run_step
from hivenet_router.policy.plugins import RouteInput
from hivenet_router.policy.predicted import (
    EXPLORE_EVERY,
    Prediction,
    predict,
    prediction_of,
    predictions,
    wait_s,
)
from hivenet_router.routing.prefix import PrefixIndex
from hivenet_router.routing.ttft import Rates
from tests.unit.policy.agents import Agent, agent

LONG = "A long document to read before the question. " * 400  # about 4,600 tokens
FAST = Rates(base_s=0.02, prefill_s=0.00005, samples=10)
SLOW = Rates(base_s=0.02, prefill_s=0.0005, samples=10)


def step_of(text: str) -> Step:
    return parse_policy(f"routing_policy: {text}\n", "p.yaml", "p", require_models=False).steps[0]


PREDICTED = step_of("{strategy: predicted-latency}")


def inp_for(text: str, rates: dict[str, Rates], index: PrefixIndex | None = None) -> RouteInput:
    facts = RequestFacts(
        "/v1/chat/completions", "m1", "llm", True, 64, text_bytes=len(text), prompt=(text,)
    )
    return RouteInput(
        facts, affinity=index, rng=random.Random(1), rates=lambda p: rates.get(p, Rates())
    )


def fleet(*peers: str) -> list[Agent]:
    return [Agent(agent(peer=p, capacity=16).reg, last_assigned=i) for i, p in enumerate(peers)]


def pick(step: Step, inp: RouteInput, agents: list[Agent]) -> str:
    chosen = run_step(step, inp, agents, set()).agent
    assert chosen is not None
    return chosen.peer_id


def test_a_cold_long_prompt_goes_to_the_fast_engine() -> None:
    agents = fleet("slow", "fast")
    inp = inp_for(LONG, {"slow": SLOW, "fast": FAST})
    assert pick(PREDICTED, inp, agents) == "fast"
    assert must(prediction_of(inp, "fast")).seconds < must(prediction_of(inp, "slow")).seconds


def test_a_hot_prefix_stays_where_it_is_cached_even_on_the_slower_engine() -> None:
    index = PrefixIndex()
    agents = fleet("slow", "fast")
    inp = inp_for(LONG, {"slow": SLOW, "fast": FAST}, index)
    index.learn(inp.blocks(), "slow", 0.0)
    assert pick(PREDICTED, inp, agents) == "slow"
    assert must(prediction_of(inp, "slow")).cached_tokens > 4000


def test_ties_go_to_the_most_cached_then_the_least_busy() -> None:
    index = PrefixIndex()
    agents = fleet("a", "b", "c")
    short = "hi " * 100
    inp = inp_for(short, {}, index)
    index.learn(inp.blocks()[:1], "c", 0.0)
    assert pick(PREDICTED, inp, agents) == "c"
    agents[2].active = 3
    agents[0].active = 1
    inp = inp_for("other " * 10, {}, index)
    assert pick(PREDICTED, inp, agents) == "b"


def test_a_queue_in_the_engine_is_priced() -> None:
    snapshot = EngineSnapshot(running_requests=4, waiting_requests=2)
    busy = Agent(agent(peer="busy").reg, engine=snapshot)
    rates = Rates(service_s=1.0, slots=4, samples=10)
    assert wait_s(busy, rates) == 0.5
    busy.active = 7  # the router's own requests beyond the batch: four ahead of this one
    assert wait_s(busy, rates) == 1.0
    assert wait_s(busy, Rates()) == 0.0  # no service time learnt: no wait priced
    assert predict(busy, rates, 100, 0).seconds == 1.0 + rates.base_s + rates.prefill_s * 100


def test_the_load_guard_passes_over_a_much_busier_engine() -> None:
    agents = fleet("slow", "fast")
    agents[1].active = 9
    assert pick(PREDICTED, inp_for(LONG, {"slow": SLOW, "fast": FAST}), agents) == "slow"


def test_an_objective_keeps_the_cache_while_it_is_fast_enough() -> None:
    index = PrefixIndex()
    agents = fleet("a", "b")
    rates = {"a": Rates(0.02, 0.00001, samples=10), "b": Rates(0.01, 0.00001, samples=10)}
    inp = inp_for(LONG, rates, index)
    index.learn(inp.blocks()[:2], "a", 0.0)
    # Without an objective the faster base wins (a's two blocks save less than 10 ms).
    assert pick(PREDICTED, inp, agents) == "b"
    with_objective = step_of("{strategy: predicted-latency, prediction: {ttft_objective_ms: 100}}")
    assert pick(with_objective, inp_for(LONG, rates, index), agents) == "a"


def test_cold_agents_borrow_the_fastest_measured_figures() -> None:
    agents = fleet("known", "new")
    inp = inp_for(LONG, {"known": SLOW})
    first, second = predictions(inp, agents)
    assert first.seconds == second.seconds


def test_the_ttft_scorer_ranks_by_prediction() -> None:
    step = step_of("{strategy: scored, scoring: {preset: load-balanced, weights: {ttft: 5}}}")
    assert step.plan.predicts and step.plan.uses_prefix
    agents = fleet("slow", "fast")
    assert pick(step, inp_for(LONG, {"slow": SLOW, "fast": FAST}), agents) == "fast"


def test_an_unmeasured_agent_is_tried_on_cheap_prompts_only() -> None:
    agents = fleet("known", "new")
    agents[0].last_assigned = 5  # chosen more recently: "new" would win a plain tie
    rates = {"known": FAST}
    assert pick(PREDICTED, inp_for("short question " * 20, rates), agents) == "new"
    assert pick(PREDICTED, inp_for(LONG, rates), agents) == "known"


def must(prediction: Prediction | None) -> Prediction:
    assert prediction is not None
    return prediction


def test_a_new_agent_is_tried_on_a_long_prompt_once_passed_over_long_enough() -> None:
    """Where every prompt is long, an agent not measured yet would never win a tie (a long
    miss pays its unknown speed): after EXPLORE_EVERY assignments to others it takes one,
    so a new fast engine is not starved beside a slow measured one (found by a new user)."""
    inp = inp_for(LONG, {"known": SLOW})
    agents = [
        Agent(agent(peer="known", capacity=16).reg, last_assigned=100),
        Agent(agent(peer="new", capacity=16).reg, last_assigned=100 - EXPLORE_EVERY + 1),
    ]
    assert pick(PREDICTED, inp, agents) == "known"
    agents[1] = Agent(agent(peer="new", capacity=16).reg, last_assigned=100 - EXPLORE_EVERY)
    assert pick(PREDICTED, inp_for(LONG, {"known": SLOW}), agents) == "new"
