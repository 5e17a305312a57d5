"""One policy step over candidates handed in as data: no registry, clock or network."""

from __future__ import annotations

from hivenet_router.domain.agent import EngineSnapshot
from hivenet_router.domain.request import RequestFacts
from hivenet_router.policy.document import BUILT_IN, parse_policy
from hivenet_router.policy.executor import run_step
from hivenet_router.policy.plugins import BestPicker, GateFilter, LoadScorer, RouteInput
from hivenet_router.policy.strategies import NAMES
from tests.unit.policy.agents import Agent, agent

FACTS = RouteInput(RequestFacts("/v1/chat/completions", "m1", "llm", False, None))
STEP = BUILT_IN.steps[0]


def test_least_loaded_then_the_agent_that_served_last() -> None:
    busy = agent(peer="busy", active=3, last_served=9)
    warm = agent(peer="warm", active=1, last_served=5, last_assigned=1)
    cold = agent(peer="cold", active=1, last_served=2, last_assigned=7)
    assert run_step(STEP, FACTS, [busy, cold, warm], set()).agent is warm
    # Load still comes first: the warm agent is passed over once it is busier.
    warm.active = 2
    assert run_step(STEP, FACTS, [busy, cold, warm], set()).agent is cold


def test_filters_in_the_documented_order() -> None:
    sick = agent(peer="sick", eligible=False)
    embedder = agent(peer="embedder", capability="embedding")
    failed = agent(peer="failed")
    assert run_step(STEP, FACTS, [sick, embedder, failed], {"failed"}).agent is None
    # Everybody left is at capacity: worth waiting for.
    full = agent(peer="full", active=4)
    choice = run_step(STEP, FACTS, [sick, full], set())
    assert choice.agent is None and choice.full
    # A free agent the gates keep out does not end the step while another is busy: the
    # request waits for the busy one (whatever it shows now: capacity comes first).
    gated = parse_policy(
        "routing_policy:\n  strategy: least-loaded\n"
        "  exclude_if: {kv_cache_utilization: {gt: 0.5}}\n",
        "p.yaml",
        "p",
        require_models=False,
    ).steps[0]
    hot = Agent(agent(peer="hot").reg, engine=EngineSnapshot(kv_cache_utilization=0.9))
    choice = run_step(gated, FACTS, [hot, full], set())
    assert choice.agent is None and choice.full
    hot_and_full = Agent(
        agent(peer="hot-full", active=4).reg,
        active=4,
        engine=EngineSnapshot(kv_cache_utilization=0.9),
    )
    choice = run_step(gated, FACTS, [hot, hot_and_full], set())
    assert choice.agent is None and choice.full
    assert run_step(gated, FACTS, [hot_and_full], set()).full  # busy and hot: still waited for
    assert not run_step(gated, FACTS, [hot], set()).full  # nobody busy: exhausted
    cool = Agent(agent(peer="cool").reg, engine=EngineSnapshot(kv_cache_utilization=0.1))
    assert run_step(gated, FACTS, [hot, cool], set()).agent is cool


def test_static_match() -> None:
    step = parse_policy(
        "routing_policy: {strategy: least-loaded, match: {region: us}}\n",
        "p.yaml",
        "p",
        require_models=False,
    ).steps[0]
    eu, us = agent(peer="eu", region="eu"), agent(peer="us", region="us", active=3)
    assert run_step(step, FACTS, [eu, us], set()).agent is us


def test_the_plugins_on_their_own() -> None:
    agents = [agent(peer="a", active=0), agent(peer="b", active=2)]
    assert LoadScorer().score(FACTS, agents) == [1.0, 0.5]
    assert BestPicker().pick(FACTS, agents, [0.2, 0.9]) is agents[1]
    assert BestPicker().pick(FACTS, [], []) is None
    hot = Agent(agent(peer="hot").reg, engine=EngineSnapshot(kv_cache_utilization=0.9))
    gate = (
        parse_policy(
            "routing_policy:\n  strategy: least-loaded\n"
            "  exclude_if: {kv_cache_utilization: {gte: 0.9}}\n",
            "p.yaml",
            "p",
            require_models=False,
        )
        .steps[0]
        .gates
    )
    assert GateFilter(gate).filter(FACTS, [hot, *agents]) == agents
    assert "least-loaded" in NAMES
