"""Every strategy over candidates handed in as data: properties that hold for any fleet,
and the behaviour each one promises."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hivenet_router.domain.request import RequestFacts
from hivenet_router.policy.document import Step, parse_policy
from hivenet_router.policy.executor import run_step
from hivenet_router.policy.plugins import RouteInput
from hivenet_router.policy.reader import PolicyError
from hivenet_router.policy.strategies import NAMES
from hivenet_router.routing.prefix import PrefixIndex
from tests.unit.policy.agents import Agent, agent

SYSTEM = "You are a careful assistant. " * 40


def step_of(yaml_step: str) -> Step:
    return parse_policy(
        f"routing_policy: {yaml_step}\n", "p.yaml", "p", require_models=False
    ).steps[0]


STEPS = {
    "least-loaded": step_of("{strategy: least-loaded}"),
    "round-robin": step_of("{strategy: round-robin}"),
    "power-of-two": step_of("{strategy: power-of-two}"),
    "lowest-srtt": step_of("{strategy: lowest-srtt}"),
    "consistent-hash": step_of("{strategy: consistent-hash}"),
    "consistent-hash-prefix": step_of("{strategy: consistent-hash, hash: {key: prefix}}"),
    "prefix-affinity": step_of("{strategy: prefix-affinity, affinity: {max_imbalance: 4}}"),
    **{
        f"scored-{preset}": step_of(f"{{strategy: scored, scoring: {{preset: {preset}}}}}")
        for preset in ("latency-first", "cost-first", "load-balanced", "speculative")
    },
    "scored-softmax": step_of("{strategy: scored, scoring: {temperature: 0.5}}"),
    "scored-ttft": step_of("{strategy: scored, scoring: {weights: {ttft: 1}}}"),
    "predicted-latency": step_of("{strategy: predicted-latency}"),
    "predicted-latency-objective": step_of(
        "{strategy: predicted-latency, prediction: {ttft_objective_ms: 50, max_imbalance: 2}}"
    ),
}


def test_every_strategy_name_is_exercised() -> None:
    named = {name.split("-scored")[0] for name in STEPS}
    assert {n for n in NAMES if not any(k.startswith(n) for k in named)} == set()


def facts(text: str = SYSTEM) -> RequestFacts:
    return RequestFacts("/v1/chat/completions", "m1", "llm", True, 64, prompt=(text,))


def route(
    step: Step, agents: list[Agent], index: PrefixIndex | None = None, **kw: object
) -> Agent | None:
    inp = RouteInput(facts(), affinity=index, rng=random.Random(7), **kw)  # type: ignore[arg-type]
    return run_step(step, inp, agents, set()).agent


fleets = st.lists(
    st.tuples(
        st.integers(min_value=0, max_value=8),  # active
        st.integers(min_value=1, max_value=8),  # capacity
        st.none() | st.floats(min_value=1, max_value=500),  # srtt
        st.booleans(),  # eligible
    ),
    min_size=1,
    max_size=8,
)


@settings(max_examples=150, deadline=None)
@given(fleet=fleets, name=st.sampled_from(sorted(STEPS)), session=st.none() | st.text(max_size=8))
def test_no_pick_outside_the_candidates_or_of_a_full_agent(
    fleet: list[tuple[int, int, float | None, bool]], name: str, session: str | None
) -> None:
    agents = [
        Agent(
            agent(peer=f"a{i}", capacity=cap).reg,
            active=min(active, cap),
            srtt_ms=srtt,
            eligible=ok,
            last_assigned=i,
        )
        for i, (active, cap, srtt, ok) in enumerate(fleet)
    ]
    index = PrefixIndex()
    index.learn(RouteInput(facts()).blocks(), "a0", 0.0)
    chosen = route(STEPS[name], agents, index, session=session)
    free = [a for a in agents if a.eligible and a.active < a.reg.capacity]
    if free:
        assert chosen in free
    else:
        assert chosen is None


def one_at_a_time(strategy: str, agents: list[Agent], requests: int, stamp: str) -> list[str]:
    """Who `strategy` picks for requests sent one at a time; before the next, the one
    picked gets the newest order in `stamp` (chosen: last_assigned, served: last_served)."""
    seen = []
    for n in range(requests):
        chosen = route(STEPS[strategy], agents)
        assert chosen is not None
        setattr(chosen, stamp, 10 + n)
        seen.append(chosen.peer_id)
    return seen


def test_round_robin_visits_everyone_in_turn() -> None:
    agents = [agent(peer=p) for p in "abc"]
    seen = one_at_a_time("round-robin", agents, 6, "last_assigned")
    assert seen == ["a", "b", "c", "a", "b", "c"]


def test_least_loaded_keeps_light_traffic_on_one_agent() -> None:
    # One request at a time: every agent is idle at each choice, and the one that served
    # last serves again, so the others can sleep. Round robin (above) spreads instead.
    agents = [agent(peer=p, last_served=n) for n, p in enumerate("abc")]
    assert one_at_a_time("least-loaded", agents, 4, "last_served") == ["c", "c", "c", "c"]
    # Two at once: the second goes to an idle agent, the warmer of the two left.
    agents[2].active = 1
    assert route(STEPS["least-loaded"], agents) is agents[1]


def test_lowest_srtt_prefers_the_fastest_and_tries_the_unmeasured() -> None:
    fast = Agent(agent(peer="fast").reg, srtt_ms=20.0, successes=50)
    slow = Agent(agent(peer="slow").reg, srtt_ms=90.0, successes=50)
    assert route(STEPS["lowest-srtt"], [slow, fast]) is fast
    new = Agent(agent(peer="new").reg, srtt_ms=None, last_assigned=-1)
    assert route(STEPS["lowest-srtt"], [slow, fast, new]) is new
    # A few answers are not yet a measurement: a cold start must not starve it.
    young = Agent(agent(peer="young").reg, srtt_ms=500.0, successes=3, last_assigned=-1)
    assert route(STEPS["lowest-srtt"], [slow, fast, young]) is young


def test_consistent_hash_keeps_a_session_and_moves_only_the_leavers_keys() -> None:
    agents = [agent(peer=f"a{i}", capacity=1000) for i in range(5)]
    keys = [f"session-{n}" for n in range(200)]
    before = {k: route(STEPS["consistent-hash"], agents, session=k) for k in keys}
    again = {k: route(STEPS["consistent-hash"], agents, session=k) for k in keys}
    assert before == again
    gone = agents[2]
    after = {
        k: route(STEPS["consistent-hash"], [a for a in agents if a is not gone], session=k)
        for k in keys
    }
    moved = [k for k in keys if before[k] is not after[k]]
    assert moved and all(before[k] is gone for k in moved)


@settings(max_examples=60, deadline=None)
@given(
    agents_count=st.integers(min_value=1, max_value=8),
    requests=st.integers(min_value=1, max_value=300),
    hot=st.booleans(),
)
def test_consistent_hash_bounds_every_agents_load(
    agents_count: int, requests: int, hot: bool
) -> None:
    """However skewed the keys (all the same key when `hot`), no agent holds more than the
    load factor times the average, rounded up."""
    agents = [Agent(agent(peer=f"a{i}", capacity=10_000).reg) for i in range(agents_count)]
    step = STEPS["consistent-hash"]
    factor = step.options.load_factor
    for n in range(requests):
        chosen = route(step, agents, session="hot" if hot else f"k{n % 7}")
        assert chosen is not None
        chosen.active += 1
        total = sum(a.active for a in agents)
        assert max(a.active for a in agents) <= math.ceil(factor * total / agents_count)


def test_prefix_affinity_follows_the_prefix_until_the_load_guard() -> None:
    index = PrefixIndex()
    agents = [Agent(agent(peer=p, capacity=100).reg) for p in "abc"]
    blocks = RouteInput(facts()).blocks()
    assert blocks
    index.learn(blocks, "b", 0.0)
    assert route(STEPS["prefix-affinity"], agents, index).peer_id == "b"  # type: ignore[union-attr]
    agents[1].active = 5  # four more than the least busy: the guard still lets it through
    agents[0].active = agents[2].active = 1
    assert route(STEPS["prefix-affinity"], agents, index).peer_id == "b"  # type: ignore[union-attr]
    agents[1].active = 6
    chosen = route(STEPS["prefix-affinity"], agents, index)
    assert chosen is not None and chosen.peer_id != "b"


def test_prefix_affinity_spreads_new_prefixes_over_the_emptiest_cache() -> None:
    index = PrefixIndex()
    agents = [Agent(agent(peer=p).reg) for p in "ab"]
    index.learn(RouteInput(facts("other text " * 200)).blocks(), "a", 0.0)
    assert route(STEPS["prefix-affinity"], agents, index).peer_id == "b"  # type: ignore[union-attr]


def test_cost_first_prefers_the_cheaper_engine() -> None:
    step = step_of(
        "{strategy: scored, scoring: {preset: cost-first, costs: ["
        "{match: {engine: vllm}, usd_per_million_tokens: 2.0},"
        "{match: {engine: ollama}, usd_per_million_tokens: 0.1}]}}"
    )
    dear = agent(peer="dear", engine="vllm")
    cheap = agent(peer="cheap", engine="ollama")
    assert route(step, [dear, cheap]) is cheap


def test_health_scores_steer_away_from_a_failing_agent() -> None:
    step = step_of("{strategy: scored, scoring: {weights: {load: 0.1, breaker: 1}}}")
    good, bad = agent(peer="good", last_assigned=5), agent(peer="bad", last_assigned=1)
    assert route(step, [good, bad], health=lambda peer: 0.2 if peer == "bad" else 1.0) is good


def test_softmax_spreads_by_score() -> None:
    step = step_of("{strategy: scored, scoring: {weights: {load: 1}, temperature: 0.2}}")
    idle, busy = Agent(agent(peer="idle").reg), Agent(agent(peer="busy").reg, active=3)
    inp = RouteInput(facts(), rng=random.Random(1))
    picks = [run_step(step, inp, [idle, busy], set()).agent for _ in range(400)]
    share = picks.count(idle) / len(picks)
    # exp(0.75 / 0.2) : 1 -> about 98% to the idle agent, but never all of it.
    assert 0.9 < share < 1.0


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        (
            "routing_policy: {strategy: scored, scoring: {weights: {speed: 1}}}",
            "scoring.weights.speed: unknown scorer",
        ),
        (
            "routing_policy: {strategy: scored, scoring: {weights: {load: -1}}}",
            "scoring.weights.load: must be between 0",
        ),
        (
            "routing_policy: {strategy: scored, scoring: {temperature: 0}}",
            "scoring.temperature: must be more than 0",
        ),
        (
            "routing_policy: {strategy: scored, scoring: {temperature: -2}}",
            "scoring.temperature: must be more than 0",
        ),
        (
            "routing_policy: {strategy: scored, scoring: {preset: cost-first, "
            "weights: {cost: 0, load: 0, latency: 0, breaker: 0}}}",
            "scoring.weights: at least one must be positive",
        ),
        (
            "routing_policy: {strategy: scored, scoring: {preset: fastest}}",
            "scoring.preset: must be one of",
        ),
        (
            "routing_policy: {strategy: least-loaded, affinity: {min_match: 0.5}}",
            "affinity: is read only by strategy prefix-affinity",
        ),
        (
            "routing_policy: {strategy: prefix-affinity, affinity: {min_match: 1.5}}",
            "affinity.min_match: must be at least 0",
        ),
        (
            "routing_policy: {strategy: predicted-latency, prediction: {ttft_objective_ms: 0}}",
            "prediction.ttft_objective_ms: must be more than 0",
        ),
        (
            "routing_policy: {strategy: predicted-latency, prediction: {min_match: 0.5}}",
            "prediction.min_match: unknown field",
        ),
        (
            "routing_policy: {strategy: least-loaded, prediction: {max_imbalance: 2}}",
            "prediction: is read only by strategy predicted-latency",
        ),
        (
            "routing_policy: {strategy: consistent-hash, hash: {key: user}}",
            "hash.key: must be one of session, prefix",
        ),
        (
            "routing_policy: {strategy: consistent-hash, hash: {load_factor: 0.5}}",
            "hash.load_factor",
        ),
        (
            "routing_policy: {strategy: least-loaded}\ncircuit_breaker: {window: 1}",
            "p.yaml:2: circuit_breaker.window: must be between 2 and 10000",
        ),
        (
            "routing_policy: {strategy: least-loaded}\ncircuit_breaker: {error_rate: 1.5}",
            "circuit_breaker.error_rate",
        ),
        (
            "routing_policy: {strategy: least-loaded}\ncircuit_breaker: {probes: 3}",
            "circuit_breaker.probes: unknown field",
        ),
        (
            "routing_policy: {strategy: least-loaded}\ncircuit_breaker: {enabled: 1}",
            "circuit_breaker.enabled: must be true or false",
        ),
        (
            "routing_policy: {strategy: least-loaded}\nadaptive_concurrency: {alpha: 5, beta: 2}",
            "adaptive_concurrency.beta: must be more than alpha",
        ),
        (
            "routing_policy: {strategy: least-loaded}\nadaptive_concurrency: {backoff: 1}",
            "adaptive_concurrency.backoff",
        ),
    ],
)
def test_bad_options_are_refused_naming_the_field(text: str, needle: str) -> None:
    with pytest.raises(PolicyError, match=needle.replace("[", r"\[").replace("(", r"\(")):
        parse_policy(text + "\n", "p.yaml", "p", require_models=False)


def test_settings_are_read() -> None:
    policy = parse_policy(
        "routing_policy: {strategy: least-loaded}\n"
        "circuit_breaker: {consecutive_failures: 3, open_seconds: 2.5, enabled: true}\n"
        "adaptive_concurrency: {enabled: true, initial_limit: 2}\n",
        "p.yaml",
        "p",
        require_models=False,
    )
    assert policy.breaker.consecutive_failures == 3 and policy.breaker.open_seconds == 2.5
    assert policy.adaptive.enabled and policy.adaptive.initial_limit == 2


def test_defaults_follow_what_was_set() -> None:
    """A window below the default min_requests, or an alpha above the default beta, is a
    valid setting: the dependent default moves instead of refusing the policy."""
    policy = parse_policy(
        "routing_policy: {strategy: least-loaded}\n"
        "circuit_breaker: {window: 5}\n"
        "adaptive_concurrency: {alpha: 8}\n",
        "p.yaml",
        "p",
        require_models=False,
    )
    assert policy.breaker.window == 5 and policy.breaker.min_requests == 5
    assert policy.adaptive.alpha == 8 and policy.adaptive.beta == 16
