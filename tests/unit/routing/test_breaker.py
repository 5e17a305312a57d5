from __future__ import annotations

import dataclasses
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hivenet_router.routing.breaker import (
    RANGES,
    Breaker,
    BreakerSettings,
    BreakerState,
    check_settings,
)

CLOSED, OPEN, HALF_OPEN = BreakerState.CLOSED, BreakerState.OPEN, BreakerState.HALF_OPEN
ONLY_STREAK = BreakerSettings(consecutive_failures=3, error_rate=0.0)
ONLY_RATE = BreakerSettings(consecutive_failures=0, error_rate=0.5, window=10, min_requests=4)


def fail(b: Breaker, s: BreakerSettings, now: float = 0.0, times: int = 1) -> BreakerState | None:
    change = None
    for _ in range(times):
        b.started(now, s)
        change = b.record(False, now, s) or change
    return change


def succeed(b: Breaker, s: BreakerSettings, now: float = 0.0, times: int = 1) -> None:
    for _ in range(times):
        b.started(now, s)
        b.record(True, now, s)


def opened(s: BreakerSettings, now: float = 0.0) -> Breaker:
    b = Breaker()
    fail(b, s, now, times=s.consecutive_failures)
    assert b.state(now, s) is OPEN
    return b


def half_open(s: BreakerSettings) -> Breaker:
    b = opened(s)
    assert b.state(s.open_seconds, s) is HALF_OPEN
    return b


def test_a_new_breaker_is_closed_and_lets_requests_through() -> None:
    b = Breaker()
    s = BreakerSettings()
    assert b.state(0.0, s) is CLOSED
    assert b.allows(0.0, s)
    assert b.opened_at is None
    assert b.transitions == {"closed": 0, "open": 0, "half_open": 0}


def test_a_streak_of_failures_opens_it_exactly_at_the_threshold() -> None:
    b = Breaker()
    assert fail(b, ONLY_STREAK, times=2) is None
    assert b.state(0.0, ONLY_STREAK) is CLOSED
    assert fail(b, ONLY_STREAK, now=1.5) is OPEN
    assert b.opened_at == 1.5
    assert b.transitions["open"] == 1
    assert not b.allows(1.5, ONLY_STREAK)


def test_a_success_breaks_the_streak() -> None:
    b = Breaker()
    fail(b, ONLY_STREAK, times=2)
    succeed(b, ONLY_STREAK)
    fail(b, ONLY_STREAK, times=2)
    assert b.state(0.0, ONLY_STREAK) is CLOSED
    assert fail(b, ONLY_STREAK) is OPEN


def test_outcomes_that_are_nobodys_fault_count_for_nothing() -> None:
    b = Breaker()
    fail(b, ONLY_STREAK, times=2)
    for _ in range(5):
        b.started(0.0, ONLY_STREAK)
        assert b.record(None, 0.0, ONLY_STREAK) is None
    assert b.outcomes_in_window == 2
    assert fail(b, ONLY_STREAK) is OPEN


def test_zero_consecutive_failures_turns_the_streak_trigger_off() -> None:
    s = BreakerSettings(consecutive_failures=0, error_rate=0.0)
    b = Breaker()
    fail(b, s, times=500)
    assert b.state(0.0, s) is CLOSED


def test_the_error_rate_waits_for_min_requests() -> None:
    b = Breaker()
    fail(b, ONLY_RATE, times=3)
    assert b.state(0.0, ONLY_RATE) is CLOSED
    assert fail(b, ONLY_RATE) is OPEN


def test_the_error_rate_opens_it_when_it_reaches_the_threshold() -> None:
    b = Breaker()
    succeed(b, ONLY_RATE, times=3)
    assert fail(b, ONLY_RATE, times=2) is None
    assert (b.failures_in_window, b.outcomes_in_window) == (2, 5)
    # 3 of 6 is exactly the 0.5 threshold.
    assert fail(b, ONLY_RATE) is OPEN


def test_the_rate_is_taken_over_a_sliding_window() -> None:
    s = dataclasses.replace(ONLY_RATE, error_rate=0.6, window=5, min_requests=5)
    b = Breaker()
    fail(b, s, times=2)
    succeed(b, s, times=3)
    # The window now holds 2 failures of 5; two more failures push the old ones out.
    assert fail(b, s) is None
    assert (b.failures_in_window, b.outcomes_in_window) == (2, 5)
    assert fail(b, s) is None
    assert b.failures_in_window == 2
    assert fail(b, s) is OPEN


def test_zero_error_rate_turns_the_rate_trigger_off() -> None:
    s = dataclasses.replace(ONLY_RATE, error_rate=0.0)
    b = Breaker()
    for _ in range(50):
        fail(b, s)
        succeed(b, s)
    assert b.state(0.0, s) is CLOSED


def test_open_refuses_until_open_seconds_then_turns_half_open() -> None:
    s = BreakerSettings(open_seconds=10.0)
    b = opened(s, now=100.0)
    assert not b.allows(109.99, s)
    assert b.state(109.99, s) is OPEN
    assert b.state(110.0, s) is HALF_OPEN
    assert b.allows(110.0, s)
    assert b.transitions == {"closed": 0, "open": 1, "half_open": 1}


def test_half_open_lets_through_only_the_probes() -> None:
    s = BreakerSettings(half_open_probes=2)
    b = half_open(s)
    now = s.open_seconds
    assert b.allows(now, s)
    assert b.allows(now, s), "allows reserves nothing"
    b.started(now, s)
    assert b.allows(now, s)
    b.started(now, s)
    assert b.probes_in_flight == 2
    assert not b.allows(now, s)


def test_a_probe_whose_client_left_frees_its_place() -> None:
    s = BreakerSettings(half_open_probes=1)
    b = half_open(s)
    now = s.open_seconds
    b.started(now, s)
    assert not b.allows(now, s)
    assert b.record(None, now, s) is None
    assert b.probes_in_flight == 0
    assert b.allows(now, s)
    assert b.state(now, s) is HALF_OPEN


def test_a_failed_probe_opens_it_again_and_restarts_the_timer() -> None:
    s = BreakerSettings(half_open_probes=2, open_seconds=10.0)
    b = half_open(s)
    b.started(12.0, s)
    assert b.record(True, 12.0, s) is None
    b.started(13.0, s)
    assert b.record(False, 13.0, s) is OPEN
    assert b.opened_at == 13.0
    assert b.probes_in_flight == 0
    assert b.state(22.9, s) is OPEN
    assert b.state(23.0, s) is HALF_OPEN
    assert b.transitions == {"closed": 0, "open": 2, "half_open": 2}


def test_enough_successful_probes_close_it_with_a_fresh_window() -> None:
    s = BreakerSettings(half_open_probes=2)
    b = half_open(s)
    now = s.open_seconds
    b.started(now, s)
    b.started(now, s)
    assert b.record(True, now, s) is None
    assert b.record(True, now, s) is CLOSED
    assert b.opened_at is None
    assert (b.failures_in_window, b.outcomes_in_window) == (0, 0)
    assert b.snapshot(now, s)["consecutive_failures"] == 0
    # The failures that opened it are forgotten: it takes a whole new streak to open again.
    assert fail(b, s, now, times=s.consecutive_failures - 1) is None
    assert fail(b, s, now) is OPEN


def test_late_outcomes_while_open_change_nothing() -> None:
    s = BreakerSettings()
    b = Breaker()
    tickets = [b.started(0.0, s) for _ in range(8)]
    fail(b, s, times=s.consecutive_failures)
    for ticket in tickets[:4]:
        assert b.record(True, 1.0, s, ticket) is None
    for _ in range(4):
        assert b.record(True, 1.0, s) is None
    assert b.state(1.0, s) is OPEN
    assert b.probes_in_flight == 0


def test_a_ticketed_late_outcome_is_not_taken_for_a_probe() -> None:
    s = BreakerSettings(half_open_probes=1)
    b = Breaker()
    old = b.started(0.0, s)
    fail(b, s, times=s.consecutive_failures)
    probe = b.started(s.open_seconds, s)
    assert b.probes_in_flight == 1
    assert b.record(True, s.open_seconds, s, old) is None
    assert b.probes_in_flight == 1
    assert b.record(True, s.open_seconds, s, probe) is CLOSED


def test_an_unticketed_outcome_with_no_probe_out_is_ignored_while_half_open() -> None:
    s = BreakerSettings(half_open_probes=1)
    b = half_open(s)
    now = s.open_seconds
    assert b.record(False, now, s) is None
    assert b.state(now, s) is HALF_OPEN
    assert b.probes_in_flight == 0


def test_started_past_the_probe_limit_does_not_count_beyond_it() -> None:
    s = BreakerSettings(half_open_probes=2)
    b = half_open(s)
    for _ in range(5):
        b.started(s.open_seconds, s)
    assert b.probes_in_flight == 2


def test_a_request_started_while_open_reserves_nothing() -> None:
    s = BreakerSettings()
    b = opened(s)
    b.started(1.0, s)
    assert b.probes_in_flight == 0


def test_disabled_always_allows_and_forgets() -> None:
    s = BreakerSettings()
    off = dataclasses.replace(s, enabled=False)
    b = opened(s)
    assert b.allows(0.0, off)
    assert b.state(0.0, off) is CLOSED
    fail(b, off, times=50)
    assert b.allows(0.0, off)
    assert b.outcomes_in_window == 0
    # Turned back on, it starts clean.
    assert b.state(0.0, s) is CLOSED
    assert fail(b, s, times=s.consecutive_failures - 1) is None


def test_a_shrinking_window_drops_the_oldest_outcomes() -> None:
    s = BreakerSettings(consecutive_failures=0, error_rate=0.9, window=10, min_requests=10)
    b = Breaker()
    fail(b, s, times=4)
    succeed(b, s, times=4)
    assert (b.failures_in_window, b.outcomes_in_window) == (4, 8)
    smaller = dataclasses.replace(s, window=5, min_requests=5)
    assert b.state(0.0, smaller) is CLOSED
    assert (b.failures_in_window, b.outcomes_in_window) == (1, 5)


def test_min_requests_above_the_window_is_held_to_the_window() -> None:
    s = BreakerSettings(consecutive_failures=0, error_rate=0.5, window=4, min_requests=50)
    b = Breaker()
    assert fail(b, s, times=4) is OPEN


def test_a_lower_probe_limit_after_a_reload_caps_probes_in_flight() -> None:
    s = BreakerSettings(half_open_probes=4)
    b = half_open(s)
    for _ in range(4):
        b.started(s.open_seconds, s)
    fewer = dataclasses.replace(s, half_open_probes=1)
    assert not b.allows(s.open_seconds, fewer)
    assert b.probes_in_flight == 1
    assert b.record(True, s.open_seconds, fewer) is CLOSED


def test_probes_dropped_by_a_reload_never_drive_the_count_negative() -> None:
    s = BreakerSettings(half_open_probes=3)
    b = half_open(s)
    now = s.open_seconds
    tickets = [b.started(now, s) for _ in range(3)]
    fewer = dataclasses.replace(s, half_open_probes=1)
    for ticket in tickets:
        assert b.record(None, now, fewer, ticket) is None
        assert b.probes_in_flight == 0
    assert b.allows(now, fewer)


def test_a_reloaded_open_seconds_applies_to_a_breaker_already_open() -> None:
    s = BreakerSettings(open_seconds=60.0)
    b = opened(s)
    assert b.state(5.0, s) is OPEN
    assert b.state(5.0, dataclasses.replace(s, open_seconds=5.0)) is HALF_OPEN


def test_snapshot_is_json_and_tells_the_time_left() -> None:
    s = BreakerSettings(open_seconds=10.0)
    b = opened(s, now=2.0)
    view = b.snapshot(5.0, s)
    json.dumps(view)
    assert view["state"] == "open"
    assert view["seconds_until_half_open"] == pytest.approx(7.0)
    assert view["error_rate"] == 1.0
    assert view["failures_in_window"] == s.consecutive_failures
    assert view["transitions"] == {"closed": 0, "open": 1, "half_open": 0}
    closed = Breaker().snapshot(0.0, s)
    json.dumps(closed)
    assert closed["seconds_until_half_open"] is None
    assert closed["error_rate"] == 0.0


def test_the_defaults_pass_the_check() -> None:
    assert check_settings(BreakerSettings()) is None
    assert set(RANGES) == {f.name for f in dataclasses.fields(BreakerSettings)} - {"enabled"}


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"window": 1}, "breaker.window: must be between 2 and 10000"),
        ({"window": 10001}, "breaker.window: must be between 2 and 10000"),
        ({"consecutive_failures": -1}, "breaker.consecutive_failures: must be between 0 and 1000"),
        ({"error_rate": 1.5}, "breaker.error_rate: must be between 0 and 1"),
        ({"error_rate": math.nan}, "breaker.error_rate: must be between 0 and 1"),
        ({"min_requests": 0}, "breaker.min_requests: must be between 1 and 20"),
        ({"min_requests": 21}, "breaker.min_requests: must be between 1 and 20"),
        ({"open_seconds": 0.0}, "breaker.open_seconds: must be more than 0 and at most 3600"),
        ({"open_seconds": 3600.5}, "breaker.open_seconds: must be more than 0 and at most 3600"),
        ({"half_open_probes": 0}, "breaker.half_open_probes: must be between 1 and 100"),
        ({"window": 2.5}, "breaker.window: must be an integer"),
        ({"half_open_probes": True}, "breaker.half_open_probes: must be a number"),
        ({"error_rate": "half"}, "breaker.error_rate: must be a number"),
    ],
)
def test_check_settings_names_the_first_bad_field(changes: dict[str, object], message: str) -> None:
    assert check_settings(dataclasses.replace(BreakerSettings(), **changes)) == message  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "changes",
    [
        {"consecutive_failures": 0, "error_rate": 0.0},
        {"error_rate": 1, "window": 2, "min_requests": 2},
        {"open_seconds": 3600, "half_open_probes": 100, "window": 10000, "min_requests": 10000},
    ],
)
def test_check_settings_accepts_the_edges(changes: dict[str, object]) -> None:
    assert check_settings(dataclasses.replace(BreakerSettings(), **changes)) is None  # type: ignore[arg-type]


@st.composite
def breaker_settings(draw: st.DrawFn) -> BreakerSettings:
    window = draw(st.integers(2, 8))
    return BreakerSettings(
        consecutive_failures=draw(st.integers(0, 4)),
        error_rate=draw(st.sampled_from([0.0, 0.25, 0.5, 1.0])),
        window=window,
        min_requests=draw(st.integers(1, window)),
        open_seconds=draw(st.sampled_from([0.5, 1.0, 3.0])),
        half_open_probes=draw(st.integers(1, 4)),
        # Mostly on: a disabled breaker has no states to explore.
        enabled=draw(st.sampled_from([True, True, True, True, False])),
    )


# Weighted so that sequences reach OPEN and HALF_OPEN often, with reloads now and then.
KINDS = ["start"] * 4 + ["record"] * 3 + ["record_ticketed"] * 3 + ["wait"] * 2 + ["reload"]


@st.composite
def breaker_op(draw: st.DrawFn) -> tuple[str, object]:
    kind = draw(st.sampled_from(KINDS))
    if kind.startswith("record"):
        return kind, draw(st.sampled_from([False, False, False, True, True, None]))
    if kind == "wait":
        return kind, draw(st.sampled_from([0.1, 0.5, 1.0, 2.0]))
    if kind == "reload":
        return kind, draw(breaker_settings())
    return kind, None


OPS = st.lists(breaker_op(), min_size=10, max_size=60)


def run(
    b: Breaker, s: BreakerSettings, ops: list[tuple[str, object]]
) -> tuple[float, BreakerSettings]:
    """Play the operations, checking the invariants after each one."""
    now = 0.0
    tickets: list[int] = []
    for op, arg in ops:
        was = b.state(now, s)
        if op == "start":
            tickets.append(b.started(now, s))
        elif op == "record":
            b.record(arg, now, s)  # type: ignore[arg-type]
        elif op == "record_ticketed" and tickets:
            b.record(arg, now, s, tickets.pop(0))  # type: ignore[arg-type]
        elif op == "wait":
            now += arg  # type: ignore[operator]
        elif op == "reload":
            s = arg  # type: ignore[assignment]
        # A reload takes effect at the breaker's next call, so look through one.
        state = b.state(now, s)
        assert 0 <= b.probes_in_flight <= s.half_open_probes
        assert 0 <= b.failures_in_window <= b.outcomes_in_window <= s.window
        assert (b.opened_at is None) == (state is CLOSED)
        if state is OPEN:
            assert b.opened_at is not None
            assert now - b.opened_at < s.open_seconds
            assert not b.allows(now, s)
        if was is OPEN and state is HALF_OPEN:
            assert b.opened_at is not None
            assert now - b.opened_at >= s.open_seconds
    return now, s


@settings(max_examples=200, deadline=None)
@given(first=breaker_settings(), ops=OPS)
def test_the_invariants_hold_under_any_sequence(
    first: BreakerSettings, ops: list[tuple[str, object]]
) -> None:
    run(Breaker(), first, ops)


@settings(max_examples=100, deadline=None)
@given(first=breaker_settings(), ops=OPS, ticketed=st.booleans(), streak=st.integers(1, 5))
def test_a_full_streak_of_failures_always_opens_it(
    first: BreakerSettings, ops: list[tuple[str, object]], ticketed: bool, streak: int
) -> None:
    b = Breaker()
    now, _ = run(b, first, ops)
    s = dataclasses.replace(first, consecutive_failures=streak, enabled=True)
    for _ in range(streak):
        ticket = b.started(now, s)
        b.record(False, now, s, ticket if ticketed else None)
    assert b.state(now, s) is OPEN
    assert not b.allows(now, s)
