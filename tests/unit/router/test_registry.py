from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hivenet_router.domain.agent import EngineSnapshot, Heartbeat, Registration
from hivenet_router.domain.request import Usage
from hivenet_router.router.registry import AgentRecord, Registry, smooth_rtt
from hivenet_router.storage.history import AgentHistory


def record(peer: str = "a", model: str = "m", capacity: int = 2) -> AgentRecord:
    reg = Registration(
        peer_id=peer, model=model, capability="llm", engine="vllm", capacity=capacity
    )
    return AgentRecord(reg=reg, link=None, last_heartbeat=0.0, registered_at=0.0)


def test_rtt_smoothing_follows_rfc_6298() -> None:
    srtt, rttvar = smooth_rtt(None, None, 100.0)
    assert (srtt, rttvar) == (100.0, 50.0)
    srtt, rttvar = smooth_rtt(srtt, rttvar, 200.0)
    assert rttvar == pytest.approx(0.75 * 50 + 0.25 * 100)
    assert srtt == pytest.approx(0.875 * 100 + 0.125 * 200)


def test_one_writer_of_per_request_statistics() -> None:
    agent = record()
    agent.finished(True, 100.0, Usage(10, 5))
    agent.finished(False, None, None)
    agent.finished(False, None, None)
    assert (agent.successes, agent.failures, agent.consecutive_failures) == (1, 2, 2)
    agent.finished(None, None, Usage(3, 0))  # the client's doing: tokens count, nothing else
    assert (agent.successes, agent.failures, agent.input_tokens) == (1, 2, 13)
    agent.finished(True, 200.0, None)
    assert agent.consecutive_failures == 0 and agent.srtt_ms == pytest.approx(112.5)


def test_warmth_follows_successes_and_a_failure_makes_the_coldest() -> None:
    early, served, late = record("early"), record("served"), record("late")
    # Never served: below any agent that did, the first to join above later ones.
    assert late.last_served < early.last_served
    served.served(True)
    assert early.last_served < served.last_served
    early.served(None)  # the client's doing: no change
    assert late.last_served < early.last_served < served.last_served
    served.served(False)
    assert served.last_served < late.last_served
    # Choosing an agent does not warm it: only how its requests end does.
    before = late.last_served
    assert late.try_acquire()
    assert late.last_served == before
    # A new connection of the same agent keeps both orders.
    again = record("served")
    again.carry(served)
    assert (again.last_served, again.last_assigned) == (served.last_served, served.last_assigned)


def test_slots_are_taken_atomically_and_released_once() -> None:
    agent = record(capacity=1)
    assert agent.try_acquire()
    assert not agent.try_acquire()
    agent.release()
    with pytest.raises(RuntimeError):
        agent.release()


def test_a_reconnect_carries_slots_and_history_and_watchers_hear_of_it() -> None:
    registry = Registry()
    heard: list[str] = []
    registry.watch(heard.append)
    old = record()
    registry.upsert(old)
    assert old.try_acquire()
    old.finished(True, 10.0, Usage(1, 1))
    new = record()
    assert registry.upsert(new) is old
    assert (new.active, new.successes, new.input_tokens) == (1, 1, 1)
    registry.release(old)  # the old connection's request ends: the new record frees it too
    assert (old.active, new.active) == (0, 0)
    assert heard == ["m", "m"]
    assert registry.for_model("m") == [new] and registry.remove("a") is new
    assert registry.models() == {}


def test_history_restores_as_baselines() -> None:
    agent = record()
    agent.finished(True, 50.0, Usage(2, 2))
    agent.restore(AgentHistory("a", successes=5, failures=1, input_tokens=100, srtt_ms=80.0))
    history = agent.history()
    assert (history.successes, history.failures, history.input_tokens) == (6, 1, 102)
    assert history.srtt_ms == 50.0  # a live sample wins over the stored one


@given(st.lists(st.floats(min_value=0.01, max_value=10_000), min_size=1, max_size=50))
def test_srtt_stays_within_the_samples(samples: list[float]) -> None:
    srtt: float | None = None
    rttvar: float | None = None
    for sample in samples:
        srtt, rttvar = smooth_rtt(srtt, rttvar, sample)
        assert rttvar >= 0
    assert srtt is not None
    assert min(samples) - 1e-6 <= srtt <= max(samples) + 1e-6


@given(st.floats(min_value=0.1, max_value=1000))
def test_steady_samples_converge(sample: float) -> None:
    srtt, rttvar = smooth_rtt(None, None, sample)
    for _ in range(200):
        srtt, rttvar = smooth_rtt(srtt, rttvar, sample)
    assert srtt == pytest.approx(sample)
    assert rttvar < sample * 1e-6


def test_a_late_release_on_a_removed_agent_leaves_its_new_registration_alone() -> None:
    registry = Registry()
    old = record(capacity=1)
    registry.upsert(old)
    assert old.try_acquire()  # a request in flight on the old connection
    registry.remove("a")  # removed (admin, or silent too long)
    new = record(capacity=1)
    registry.upsert(new)
    assert new.try_acquire()  # the agent came back and took a new request
    registry.release(old)  # the old request ends
    assert (old.held, new.held) == (0, 1)
    assert not new.try_acquire()  # still full: its one slot is in use
    registry.release(new)
    assert new.held == 0


def test_slots_taken_before_two_reconnects_are_given_back_on_the_latest() -> None:
    registry = Registry()
    first = record(capacity=2)
    registry.upsert(first)
    assert first.try_acquire()
    second = record(capacity=2)
    registry.upsert(second)  # reconnected: second carries the slot in use
    assert second.try_acquire()
    third = record(capacity=2)
    registry.upsert(third)  # and again
    assert third.held == 2
    registry.release(first)
    assert (second.held, third.held) == (1, 1)
    registry.release(second)
    assert third.held == 0


def test_a_drained_agent_stays_drained_when_it_reconnects() -> None:
    registry = Registry()
    old = record()
    registry.upsert(old)
    old.draining = True  # an operator drained it
    new = record()
    registry.upsert(new)  # its connection dropped and it came back
    assert new.draining and not new.eligible


def test_an_agent_that_says_it_stops_leaves_the_pool_and_its_next_connection_does_not() -> None:
    registry = Registry()
    old = record()
    registry.upsert(old)
    old.heard(Heartbeat(backend_healthy=True, stopping=True), now=1.0, wall=0.0)
    assert old.stopping and not old.eligible and not old.draining
    # A later heartbeat without the member (never sent by a stopping agent) does not undo it.
    old.heard(Heartbeat(backend_healthy=True), now=2.0, wall=0.0)
    assert old.stopping
    new = record()
    registry.upsert(new)  # the restarted agent registers again
    assert not new.stopping


def test_what_the_control_plane_and_the_health_monitor_learn() -> None:
    agent = record()
    agent.went_silent()
    assert not agent.process_healthy and agent.health_failures == 1
    engine = EngineSnapshot(kv_cache_tokens=100)
    went_down = agent.heard(
        Heartbeat(backend_healthy=False, inflight_total=3, routers_up=["r1"], engine=engine),
        now=5.0,
        wall=1_700_000_005.0,
    )
    assert went_down and agent.backend_failures == 1
    assert agent.process_healthy and not agent.backend_healthy
    assert (agent.last_heartbeat, agent.last_seen_wall) == (5.0, 1_700_000_005.0)
    assert agent.reported == 3 and agent.routers_up == ("r1",) and agent.engine is engine
    # Down already: a second report is not a second failure; absent parts keep their value.
    assert not agent.heard(Heartbeat(backend_healthy=False), now=6.0, wall=0.0)
    assert agent.backend_failures == 1 and agent.engine is engine and agent.reported == 0
    agent.disconnected(7.0)
    assert agent.disconnected_at == 7.0 and agent.disconnects == 1
    assert not agent.removed_silent()  # its drop was counted when it dropped
    silent = record("b")
    assert silent.removed_silent() and silent.disconnects == 1


def test_a_drain_reports_only_a_change() -> None:
    agent = record()
    assert agent.drain(True) and agent.draining
    assert not agent.drain(True)
    assert agent.drain(False) and not agent.draining
    assert not agent.drain(False)
