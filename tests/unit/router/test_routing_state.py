"""What routing learns from traffic, through its public calls, in virtual time."""

from __future__ import annotations

from typing import Any

import pytest

from hivenet_router.clock import ManualClock
from hivenet_router.domain.agent import (
    CacheChange,
    CacheReport,
    EngineSnapshot,
    Registration,
    pack_blocks,
    unpack_blocks,
)
from hivenet_router.domain.request import Job, RequestFacts, Usage
from hivenet_router.observability.events import Observers
from hivenet_router.pipeline.ticket import Ticket
from hivenet_router.policy.document import Policy, parse_policy
from hivenet_router.policy.predicted import (
    INDEXED_TOKENS,
    Prediction,
    prediction_of,
    uncached_known,
)
from hivenet_router.router.registry import AgentRecord, Registry
from hivenet_router.router.routing_state import RoutingState, Sent, queue_cost
from hivenet_router.routing.ttft import STALE_S

SYSTEM = "You are a careful assistant. " * 40


def policy(extra: str = "", strategy: str = "least-loaded") -> Policy:
    return parse_policy(
        f"routing_policy: {{strategy: {strategy}}}\n{extra}", "p.yaml", "p", require_models=False
    )


def record(registry: Registry, peer: str, capacity: int = 8) -> AgentRecord:
    reg = Registration(peer_id=peer, model="m", capability="llm", engine="vllm", capacity=capacity)
    agent = AgentRecord(reg=reg, link=None, last_heartbeat=0.0, registered_at=0.0)
    registry.upsert(agent)
    return agent


def ticket(headers: list[tuple[str, str]] | None = None, max_out: int | None = 64) -> Ticket:
    t = Ticket("r1", "/v1/chat/completions", 0.0, Observers([]))
    t.facts = RequestFacts(
        "/v1/chat/completions", "m", "llm", True, max_out, text_bytes=400, prompt=(SYSTEM,)
    )
    t.job = Job("/v1/chat/completions", "m", "llm", True, b"{}", headers or [])
    return t


def test_agent_breaker_opens_blocks_and_reports_when_to_come_back() -> None:
    clock, registry = ManualClock(), Registry()
    state = RoutingState(clock, registry)
    rules = policy(
        "circuit_breaker: {consecutive_failures: 2, open_seconds: 5, half_open_probes: 1}\n"
    )
    agent = record(registry, "a")
    inp = state.input(ticket(), rules, None)
    step = rules.steps[0]
    for _ in range(2):
        breaker = state.chosen(inp, step, agent, rules)
        state.settled(agent, rules, False, None, None, True, breaker)
    assert not state.admits(rules)(agent)
    assert state.all_open(rules, [agent]) == 5.0
    clock.advance(2.0)
    assert state.all_open(rules, [agent]) == 3.0
    view = state.agent_view("a", rules.breaker)
    assert view["breaker"]["state"] == "open" and view["breaker"]["opened_after"] == 2  # type: ignore[index]
    rows = list(state.breakers())
    assert rows == [("agent", "a", "open", {"closed": 0, "open": 1, "half_open": 0})]
    clock.advance(3.0)  # half-open: one probe, then closed on success
    assert state.admits(rules)(agent) and state.all_open(rules, [agent]) is None
    breaker = state.chosen(inp, step, agent, rules)
    state.settled(agent, rules, True, 12.0, None, True, breaker)
    assert state.agent_view("a", rules.breaker)["breaker"]["state"] == "closed"  # type: ignore[index]


def test_a_client_gone_releases_a_half_open_probe() -> None:
    clock, registry = ManualClock(), Registry()
    state = RoutingState(clock, registry)
    rules = policy(
        "circuit_breaker: {consecutive_failures: 1, open_seconds: 1, half_open_probes: 1}\n"
    )
    agent = record(registry, "a")
    inp = state.input(ticket(), rules, None)
    state.settled(
        agent, rules, False, None, None, True, state.chosen(inp, rules.steps[0], agent, rules)
    )
    clock.advance(1.0)
    probe = state.chosen(inp, rules.steps[0], agent, rules)
    assert not state.admits(rules)(agent)  # its one probe is out
    state.settled(agent, rules, None, None, None, True, probe)
    assert state.admits(rules)(agent)


def test_disabled_breakers_admit_everyone() -> None:
    clock, registry = ManualClock(), Registry()
    state = RoutingState(clock, registry)
    rules = policy("circuit_breaker: {enabled: false}\n")
    agent = record(registry, "a")
    inp = state.input(ticket(), rules, None)
    for _ in range(10):
        state.settled(
            agent, rules, False, None, None, True, state.chosen(inp, rules.steps[0], agent, rules)
        )
    assert state.admits(rules)(agent) and state.all_open(rules, [agent]) is None


def test_how_a_request_ends_decides_which_agent_is_warm() -> None:
    clock, registry = ManualClock(), Registry()
    state = RoutingState(clock, registry)
    rules = policy()
    a, b = record(registry, "a"), record(registry, "b")
    inp = state.input(ticket(), rules, None)
    assert a.last_served > b.last_served  # neither served: the first to join ranks first
    state.settled(b, rules, True, 20.0, None, True, state.chosen(inp, rules.steps[0], b, rules))
    assert b.last_served > a.last_served
    state.settled(b, rules, None, None, None, True, state.chosen(inp, rules.steps[0], b, rules))
    assert b.last_served > a.last_served  # the client's doing
    state.settled(b, rules, False, None, None, True, state.chosen(inp, rules.steps[0], b, rules))
    assert b.last_served < a.last_served


def test_provider_breaker() -> None:
    clock, registry = ManualClock(), Registry()
    state = RoutingState(clock, registry)
    rules = policy("circuit_breaker: {consecutive_failures: 2, open_seconds: 10}\n")
    for _ in range(2):
        assert state.provider_allows("openai", rules)
        state.provider_settled("openai", rules, False, state.provider_started("openai", rules))
    assert not state.provider_allows("openai", rules)
    assert next(iter(state.breakers()))[:3] == ("provider", "openai", "open")
    clock.advance(10.0)
    assert state.provider_allows("openai", rules)


def test_adaptive_limit_follows_latency_and_goes_away_when_turned_off() -> None:
    clock, registry = ManualClock(), Registry()
    state = RoutingState(clock, registry)
    on = policy("adaptive_concurrency: {enabled: true, initial_limit: 4, alpha: 1, beta: 2}\n")
    agent = record(registry, "a", capacity=8)
    state.adapt(on, [agent])
    assert agent.limit == 4 and agent.try_acquire()
    inp = state.input(ticket(), on, None)
    breaker = state.chosen(inp, on.steps[0], agent, on)
    agent.held = 4
    state.settled(agent, on, True, 10.0, None, True, breaker)  # the no-load latency
    for _ in range(5):  # then far slower: a queue inside the engine
        state.settled(agent, on, True, 80.0, None, True, breaker)
    assert 1 <= agent.limit < 4
    assert dict(state.limits()) == {"a": agent.limit}
    state.adapt(policy(), [agent])
    assert agent.limit == 8


def test_only_streams_move_the_adaptive_limit() -> None:
    """A whole answer's time grows with its length; one limiter fed both kinds would
    compare milliseconds per token with milliseconds per request."""
    clock, registry = ManualClock(), Registry()
    state = RoutingState(clock, registry)
    on = policy("adaptive_concurrency: {enabled: true}\n")
    agent = record(registry, "a")
    state.adapt(on, [agent])
    state.settled(agent, on, True, 400.0, Usage(10, 40), False, Sent())
    view = state.agent_view("a", on.breaker)["adaptive_concurrency"]
    assert view["min_latency"] is None  # type: ignore[index]
    state.settled(agent, on, True, 30.0, Usage(10, 40), True, Sent())
    view = state.agent_view("a", on.breaker)["adaptive_concurrency"]
    assert view["min_latency"] == 30.0  # type: ignore[index]


def test_a_policy_with_breakers_off_leaves_a_shared_provider_breaker_alone() -> None:
    clock, registry = ManualClock(), Registry()
    state = RoutingState(clock, registry)
    strict = policy("circuit_breaker: {consecutive_failures: 1, open_seconds: 60}\n")
    off = policy("circuit_breaker: {enabled: false}\n")
    state.provider_settled("openai", strict, False, state.provider_started("openai", strict))
    assert state.provider_allows("openai", off)  # this policy does not use breakers
    assert not state.provider_allows("openai", strict)  # and did not reset the other's


def test_prefixes_are_learnt_sized_by_the_engine_and_forgotten_with_the_agent() -> None:
    clock, registry = ManualClock(), Registry()
    state = RoutingState(clock, registry)
    rules = policy(strategy="prefix-affinity")
    agent = record(registry, "a")
    agent.engine = EngineSnapshot(kv_cache_tokens=128.0)  # 512 characters: two blocks
    inp = state.input(ticket(), rules, None)
    assert len(inp.blocks()) > 2
    state.chosen(inp, rules.steps[0], agent, rules)
    assert dict(state.prefix_blocks()) == {"m": 2}
    assert state.agent_view("a", rules.breaker)["prefix_blocks"] == 2
    # Least-loaded routes by load only: nothing is learnt.
    plain = policy()
    other = record(registry, "b")
    state.chosen(state.input(ticket(), plain, None), plain.steps[0], other, plain)
    assert dict(state.prefix_blocks()) == {"m": 2}
    registry.remove("a")
    assert dict(state.prefix_blocks()) == {"m": 0}


def test_session_header_and_queue_cost() -> None:
    state = RoutingState(ManualClock(), Registry())
    rules = policy()
    inp = state.input(ticket([("X-Session-Id", "s-1")]), rules, "x-session-id")
    assert inp.session == "s-1"
    assert state.input(ticket(), rules, "x-session-id").session is None
    assert queue_cost(ticket()) == 400 / 4 + 64
    assert queue_cost(ticket(max_out=None)) == 400 / 4 + 256


def test_an_attempt_cut_short_teaches_routing_but_counts_nothing_for_the_agent() -> None:
    clock, registry = ManualClock(), Registry()
    state = RoutingState(clock, registry)
    rules = policy("circuit_breaker: {consecutive_failures: 1, open_seconds: 5}\n")
    agent = record(registry, "a")
    inp = state.input(ticket(), rules, None)
    state.cut_short(agent, rules, False, state.chosen(inp, rules.steps[0], agent, rules))
    assert (agent.successes, agent.failures) == (0, 0)
    assert not state.admits(rules)(agent)  # the deadline ran out on it: its breaker opened
    other = record(registry, "b")
    state.settled(other, rules, True, 20.0, Usage(3, 4), True, Sent())
    assert (other.successes, other.srtt_ms, other.output_tokens) == (1, 20.0, 4)


def test_prepare_sets_limits_and_the_time_the_pick_sees() -> None:
    clock, registry = ManualClock(), Registry()
    state = RoutingState(clock, registry)
    on = policy("adaptive_concurrency: {enabled: true, initial_limit: 4}\n")
    agent = record(registry, "a", capacity=8)
    inp = state.input(ticket(), on, None)
    clock.advance(3.0)
    admits = state.prepare(inp, on, [agent])
    assert agent.limit == 4 and inp.now == clock.monotonic() and admits(agent)


def test_predicted_latency_learns_each_agents_figures_and_its_error() -> None:
    clock, registry = ManualClock(), Registry()
    state = RoutingState(clock, registry)
    rules = policy(strategy="predicted-latency")
    step = rules.steps[0]
    agent = record(registry, "a")
    assert state.prediction_errors() == (0, None, None)
    for n in range(8):
        t = ticket()
        text = str(n) + "x" * (399 + 800 * n)  # of different lengths, nothing cached
        assert t.facts is not None
        t.facts = RequestFacts(
            "/v1/chat/completions", "m", "llm", True, 64, len(text), 1, 0, (text,)
        )
        inp = state.input(t, rules, None)
        assert step.plan.choose(inp, [agent]) is agent
        sent = state.chosen(inp, step, agent, rules)
        assert sent.prediction is not None
        tokens = len(text) / 4
        ttft_ms = 1000 * (0.03 + 0.0002 * tokens)  # a 30 ms base, 5,000 tokens a second
        clock.advance(0.5)
        state.settled(agent, rules, True, ttft_ms, Usage(int(tokens), 4), True, sent)
    view = state.agent_view("a", rules.breaker)["predicted_latency"]
    assert view == {
        "base_ms": 30.0,
        "prefill_us_per_token": 200.0,
        "service_ms": 500,
        "engine_slots": None,
        "samples": 8,
        "stale": False,
    }
    count, p50, p90 = state.prediction_errors()
    assert count == 8 and p50 is not None and p90 is not None
    # The last predictions were made with the figures already learnt: exact.
    inp = state.input(ticket(), rules, None)
    step.plan.choose(inp, [agent])
    assert abs(must(prediction_of(inp, "a")).seconds - (0.03 + 0.0002 * 100)) < 1e-9
    registry.remove("a")
    assert "predicted_latency" not in state.agent_view("a", rules.breaker)


def test_agents_cache_reports_fill_the_index_and_the_prefix_goes_to_the_agent() -> None:
    clock, registry = ManualClock(), Registry()
    state = RoutingState(clock, registry)
    rules = policy(strategy="prefix-affinity")
    agent = record(registry, "a")
    agent.engine = EngineSnapshot(kv_cache_tokens=256.0)  # four blocks
    state.cache_report(agent, CacheReport(True, [CacheChange(True, pack_blocks([3, 2, 1]))]))
    state.cache_report(agent, CacheReport(False, [CacheChange(True, pack_blocks([6, 5, 4]))]))
    assert dict(state.prefix_blocks()) == {"m": 4}  # held to the engine's size
    state.cache_report(agent, CacheReport(False, [CacheChange(False, pack_blocks([4, 9]))]))
    assert dict(state.prefix_blocks()) == {"m": 3}
    state.cache_report(agent, CacheReport(True, []))  # a whole picture, empty
    assert dict(state.prefix_blocks()) == {"m": 0}
    with pytest.raises(ValueError):
        state.cache_report(agent, CacheReport(False, [CacheChange(True, "%%")]))
    assert state.reports == 4
    inp = state.input(ticket(), rules, None)
    sent = state.chosen(inp, rules.steps[0], agent, rules)
    assert sent.prefix is not None and unpack_blocks(sent.prefix) == inp.blocks()
    assert state.chosen(inp, policy().steps[0], agent, policy()).prefix is None


def must(prediction: Prediction | None) -> Prediction:
    assert prediction is not None
    return prediction


def _figures(state: RoutingState, peer: str, rules: Policy) -> dict[str, Any]:
    view = state.agent_view(peer, rules.breaker)["predicted_latency"]
    assert isinstance(view, dict)
    return view


def _stream(
    state: RoutingState,
    clock: ManualClock,
    rules: Policy,
    agents: list[AgentRecord],
    n: int,
    speed: dict[str, tuple[float, float]],
    chars: int,
) -> str:
    """One stream of `chars` characters nobody holds, chosen among `agents` and answered
    after the chosen engine's (base s, s a token) time: the peer that served it."""
    t = ticket()
    text = f"{n:08d}" + "y" * chars  # its own first block: never cached
    t.facts = RequestFacts("/v1/chat/completions", "m", "llm", True, 64, len(text), 1, 0, (text,))
    step = rules.steps[0]
    inp = state.input(t, rules, None)
    agent = step.plan.choose(inp, agents)
    assert agent is not None and agent.try_acquire()
    sent = state.chosen(inp, step, agent, rules)
    base, per_token = speed[agent.peer_id]
    clock.advance(0.2)
    ttft_ms = 1000 * (base + per_token * len(text) / 4)
    agent.release()
    state.settled(agent, rules, True, ttft_ms, Usage(len(text) // 4, 4), True, sent)
    return agent.peer_id


def test_an_engine_that_recovers_unseen_is_tried_again_once_its_figures_are_stale() -> None:
    """A slow engine gets no traffic, so nothing shows it recovered: figures unconfirmed for
    STALE_S are shown as not measured, it is tried again, and an answer then far off its
    old figures starts them afresh."""
    clock, registry = ManualClock(), Registry()
    state = RoutingState(clock, registry)
    rules = policy(strategy="predicted-latency")
    agents = [record(registry, "a"), record(registry, "b")]
    speed = {"a": (0.02, 0.00002), "b": (0.3, 0.0006)}  # b is slow
    n = 0
    for n in range(40):
        _stream(state, clock, rules, agents, n, speed, 200 + 150 * (n % 6))
    assert _figures(state, "b", rules)["samples"] >= 4
    speed["b"] = speed["a"]  # b recovers; with its old figures nobody would send it a thing
    served = [
        _stream(state, clock, rules, agents, n, speed, 200 + 150 * (n % 6)) for n in range(40, 60)
    ]
    assert "b" not in served  # 4 s: its figures are still fresh
    assert not _figures(state, "b", rules)["stale"]
    clock.advance(STALE_S)
    served = [
        _stream(state, clock, rules, agents, n, speed, 200 + 150 * (n % 6)) for n in range(60, 100)
    ]
    view = _figures(state, "b", rules)
    assert served.count("b") >= 10, served  # tried again, measured fast, and used
    assert view["base_ms"] < 30 and not view["stale"], view


def test_a_try_of_a_stale_agent_that_gives_no_stream_waits_its_turn() -> None:
    """A stale agent is tried at most once each STALE_S while nothing confirms it."""
    clock, registry = ManualClock(), Registry()
    state = RoutingState(clock, registry)
    learner = state._learner("a")
    for n in range(6):
        learner.observe(100.0 * n, 0.02 + 0.0001 * 100 * n, clock.monotonic())
    assert not learner.stale(clock.monotonic())
    clock.advance(STALE_S + 1)
    now = clock.monotonic()
    assert learner.stale(now) and learner.due(now)
    learner.probed = now
    assert learner.stale(now) and not learner.due(now + 1)
    assert learner.due(now + STALE_S + 1)


def test_a_prompt_longer_than_the_index_with_all_of_it_held_teaches_nothing() -> None:
    """Of a conversation longer than the prefix index covers, the engine held an unknown
    share: learning from it drove the prefill rate to zero (found by a new user)."""
    known = Prediction(0.1, 0.0, 20_000.0, 1_000.0)
    unknown = Prediction(0.1, 0.0, 20_000.0, INDEXED_TOKENS)
    assert uncached_known(known) and not uncached_known(unknown)
    assert uncached_known(Prediction(0.1, 0.0, INDEXED_TOKENS, INDEXED_TOKENS))
    clock, registry = ManualClock(), Registry()
    state = RoutingState(clock, registry)
    rules = policy(strategy="predicted-latency")
    agent = record(registry, "a")
    sent = Sent(prediction=unknown)
    state.settled(agent, rules, True, 20.0, Usage(20_000, 4), True, sent)
    view = _figures(state, "a", rules)
    assert view["samples"] == 0 and view["service_ms"] is not None
    assert state.prediction_errors()[0] == 1  # its error still counts
