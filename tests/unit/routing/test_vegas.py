from __future__ import annotations

import dataclasses
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hivenet_router.routing.vegas import RANGES, VegasLimiter, VegasSettings, check_settings

ON = VegasSettings(enabled=True)


def warmed(capacity: int, s: VegasSettings = ON, latency: float = 1.0) -> VegasLimiter:
    v = VegasLimiter(capacity, s)
    v.sample(latency, 0, capacity, s)
    return v


def test_the_limit_starts_at_the_initial_limit_within_capacity() -> None:
    assert VegasLimiter(100, ON).limit == 4
    assert VegasLimiter(2, ON).limit == 2
    assert VegasLimiter(0, ON).limit == 1
    v = VegasLimiter(100, ON)
    assert (v.min_latency, v.latency, v.queue_estimate()) == (None, None, None)


def test_a_short_queue_grows_the_limit_by_one_when_it_is_used() -> None:
    v = VegasLimiter(100, ON)
    assert v.sample(1.0, 4, 100, ON) == 5
    assert v.sample(1.0, 3, 100, ON) == 6
    assert (v.min_latency, v.latency) == (1.0, 1.0)


def test_an_unused_limit_does_not_grow() -> None:
    v = VegasLimiter(100, ON)
    assert v.sample(1.0, 1, 100, ON) == 4
    assert v.sample(1.0, 0, 100, ON) == 4
    assert v.sample(1.0, 2, 100, ON) == 5


def test_a_long_queue_backs_off_multiplicatively() -> None:
    s = dataclasses.replace(ON, initial_limit=40, smoothing=1.0)
    v = warmed(100, s)
    # queue = 40 * (1 - 1/2) = 20 > beta
    assert v.sample(2.0, 40, 100, s) == 36
    assert v.queue_estimate() == pytest.approx(18.0)


def test_a_queue_between_alpha_and_beta_holds_the_limit() -> None:
    s = dataclasses.replace(ON, initial_limit=10, smoothing=1.0)
    v = warmed(100, s)
    # queue = 10 * (1 - 1/2) = 5, between 3 and 6
    assert v.sample(2.0, 10, 100, s) == 10


def test_backing_off_never_goes_below_one() -> None:
    s = dataclasses.replace(ON, initial_limit=1, alpha=0.1, beta=0.2, smoothing=1.0)
    v = warmed(100, s)
    assert v.sample(100.0, 1, 100, s) == 1
    assert v.dropped(100, s) == 1


def test_the_latency_is_smoothed() -> None:
    s = dataclasses.replace(ON, smoothing=0.25)
    v = warmed(100, s, latency=2.0)
    v.sample(6.0, 0, 100, s)
    assert v.latency == pytest.approx(3.0)
    assert v.min_latency == 2.0


@pytest.mark.parametrize("latency", [0.0, -1.0, math.nan, math.inf, -math.inf])
def test_a_latency_that_is_not_a_positive_number_is_ignored(latency: float) -> None:
    v = warmed(100)
    before = v.snapshot()
    assert v.sample(latency, 100, 100, ON) == before["limit"]
    assert v.snapshot() == before


def test_an_ignored_sample_still_clamps_to_capacity() -> None:
    v = VegasLimiter(100, dataclasses.replace(ON, initial_limit=50))
    assert v.sample(math.nan, 0, 10, ON) == 10


def test_the_limit_never_passes_capacity() -> None:
    v = VegasLimiter(5, ON)
    for _ in range(10):
        v.sample(1.0, 5, 5, ON)
    assert v.limit == 5


def test_a_drop_backs_off() -> None:
    v = VegasLimiter(100, dataclasses.replace(ON, initial_limit=20))
    assert v.dropped(100, ON) == 18
    assert v.dropped(10, ON) == 10
    assert v.dropped(100, ON) == 9


def test_resize_clamps_the_limit() -> None:
    v = VegasLimiter(100, dataclasses.replace(ON, initial_limit=50))
    v.resize(8)
    assert v.limit == 8
    v.resize(200)
    assert v.limit == 8
    v.resize(0)
    assert v.limit == 1


def test_disabled_learns_latency_but_leaves_the_limit() -> None:
    off = VegasSettings(enabled=False, smoothing=1.0)
    v = VegasLimiter(100, off)
    assert v.sample(1.0, 4, 100, off) == 4
    assert v.sample(50.0, 4, 100, off) == 4
    assert v.dropped(100, off) == 4
    assert (v.min_latency, v.latency) == (1.0, 50.0)
    assert v.dropped(2, off) == 2


def test_a_faster_agent_lowers_the_base_at_once() -> None:
    v = warmed(100, latency=10.0)
    v.sample(4.0, 0, 100, ON)
    assert v.min_latency == 4.0


def test_a_slower_agent_gets_a_new_base_after_a_span() -> None:
    s = dataclasses.replace(ON, rebase_samples=10, smoothing=1.0)
    v = warmed(1000, s, latency=1.0)
    for _ in range(8):
        v.sample(5.0, 0, 1000, s)
    assert v.min_latency == 1.0
    v.sample(5.0, 0, 1000, s)  # the tenth sample ends the span
    assert v.min_latency == 1.0, "the span that ends still held the fast sample"
    for _ in range(9):
        v.sample(5.0, 0, 1000, s)
    assert v.min_latency == 1.0
    v.sample(5.0, 0, 1000, s)
    assert v.min_latency == 5.0
    assert v.snapshot()["span_samples"] == 0
    # With the new base the queue looks empty again, so a used limit grows once more.
    before = v.limit
    assert v.sample(5.0, v.limit, 1000, s) == before + 1


def test_a_permanently_slower_agent_stops_backing_off_after_the_rebase() -> None:
    s = dataclasses.replace(ON, initial_limit=50, rebase_samples=20)
    v = warmed(100, s, latency=1.0)
    limits = [v.sample(3.0, v.limit, 100, s) for _ in range(60)]
    assert limits[-1] > min(limits), "it grows again once the slower latency is the base"


def test_snapshot_is_json() -> None:
    v = VegasLimiter(10, ON)
    assert v.snapshot() == {
        "limit": 4,
        "min_latency": None,
        "latency": None,
        "queue_estimate": None,
        "span_samples": 0,
    }
    v.sample(2.0, 4, 10, ON)
    view = v.snapshot()
    json.dumps(view)
    assert view["limit"] == 5
    assert view["queue_estimate"] == 0.0


def test_the_defaults_pass_the_check() -> None:
    assert check_settings(VegasSettings()) is None
    assert set(RANGES) == {f.name for f in dataclasses.fields(VegasSettings)} - {"enabled"}


P = "adaptive_concurrency"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"initial_limit": 0}, f"{P}.initial_limit: must be between 1 and 100000"),
        ({"initial_limit": 100001}, f"{P}.initial_limit: must be between 1 and 100000"),
        ({"initial_limit": 4.0}, f"{P}.initial_limit: must be an integer"),
        ({"alpha": 0.0}, f"{P}.alpha: must be more than 0 and at most 100000"),
        ({"alpha": math.nan}, f"{P}.alpha: must be more than 0 and at most 100000"),
        ({"beta": 3.0}, f"{P}.beta: must be more than alpha (3)"),
        ({"beta": 2.5}, f"{P}.beta: must be more than alpha (3)"),
        ({"alpha": 1.5, "beta": 1.5}, f"{P}.beta: must be more than alpha (1.5)"),
        ({"backoff": 1.0}, f"{P}.backoff: must be more than 0 and less than 1"),
        ({"backoff": 0.0}, f"{P}.backoff: must be more than 0 and less than 1"),
        ({"smoothing": 0.0}, f"{P}.smoothing: must be more than 0 and at most 1"),
        ({"smoothing": 1.01}, f"{P}.smoothing: must be more than 0 and at most 1"),
        ({"rebase_samples": 9}, f"{P}.rebase_samples: must be between 10 and 1000000"),
        ({"rebase_samples": False}, f"{P}.rebase_samples: must be a number"),
    ],
)
def test_check_settings_names_the_first_bad_field(changes: dict[str, object], message: str) -> None:
    assert check_settings(dataclasses.replace(VegasSettings(), **changes)) == message  # type: ignore[arg-type]


def test_check_settings_accepts_the_edges() -> None:
    edges = VegasSettings(
        initial_limit=100000, alpha=1e-9, beta=100000, backoff=0.5, smoothing=1, rebase_samples=10
    )
    assert check_settings(edges) is None


capacities = st.integers(0, 40)
vegas_ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("sample"),
            st.one_of(
                st.floats(min_value=1e-3, max_value=1e3),
                st.sampled_from([0.0, -1.0, math.nan, math.inf]),
            ),
            st.integers(0, 80),
            capacities,
        ),
        st.tuples(st.just("drop"), st.none(), st.none(), capacities),
        st.tuples(st.just("resize"), st.none(), st.none(), capacities),
    ),
    max_size=80,
)
vegas_settings = st.builds(
    VegasSettings,
    enabled=st.booleans(),
    initial_limit=st.integers(1, 50),
    alpha=st.floats(0.5, 3.0),
    beta=st.floats(3.5, 10.0),
    backoff=st.floats(0.1, 0.99),
    smoothing=st.floats(0.05, 1.0),
    rebase_samples=st.integers(10, 30),
)


@settings(max_examples=300, deadline=None)
@given(s=vegas_settings, first=capacities, ops=vegas_ops)
def test_the_limit_stays_within_capacity_and_grows_one_at_a_time(
    s: VegasSettings, first: int, ops: list[tuple[str, float | None, int | None, int]]
) -> None:
    v = VegasLimiter(first, s)
    assert 1 <= v.limit <= max(1, first)
    for op, latency, inflight, capacity in ops:
        before = v.limit
        if op == "sample":
            assert latency is not None
            assert inflight is not None
            v.sample(latency, inflight, capacity, s)
            assert v.limit <= before + 1
        elif op == "drop":
            v.dropped(capacity, s)
            assert v.limit <= before
        else:
            v.resize(capacity)
        assert 1 <= v.limit <= max(1, capacity)


@settings(max_examples=50, deadline=None)
@given(capacity=st.integers(1, 60), latency=st.floats(1e-3, 1e3), s=vegas_settings)
def test_a_steady_latency_under_full_use_grows_to_capacity(
    capacity: int, latency: float, s: VegasSettings
) -> None:
    s = dataclasses.replace(s, enabled=True)
    v = VegasLimiter(capacity, s)
    for _ in range(capacity):
        v.sample(latency, v.limit, capacity, s)
    assert v.limit == capacity


@settings(max_examples=50, deadline=None)
@given(knee=st.integers(4, 60), base=st.floats(1e-3, 1e3))
def test_latency_rising_with_load_stops_growth_near_the_knee(knee: int, base: float) -> None:
    # The agent serves `knee` requests at once; past that, latency grows in step with load.
    v = VegasLimiter(1000, ON)
    for _ in range(150):
        v.sample(base * max(1.0, v.limit / knee), v.limit, 1000, ON)
        assert v.limit <= knee + ON.beta + 1
    assert v.limit >= knee


@settings(max_examples=50, deadline=None)
@given(knee=st.integers(4, 60), slope=st.floats(0.01, 0.5))
def test_latency_rising_steadily_backs_the_limit_off(knee: int, slope: float) -> None:
    v = VegasLimiter(1000, ON)
    for _ in range(100):
        v.sample(max(1.0, v.limit / knee), v.limit, 1000, ON)
    peak = v.limit
    # Now the latency keeps climbing, sample after sample: the agent is getting slower.
    limits = []
    for step in range(1, 100):
        stretch = 1.0 + slope * step
        limits.append(v.sample(stretch * max(1.0, v.limit / knee), v.limit, 1000, ON))
    assert max(limits) <= peak
    assert limits[-1] < peak
