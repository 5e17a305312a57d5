from __future__ import annotations

import math
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from hivenet_router.routing.ttft import (
    CHANGE_RUN,
    MIN_SAMPLES,
    PRIOR_BASE_S,
    PRIOR_PREFILL_S,
    STALE_S,
    WINDOW,
    Learner,
    median,
)

speeds = st.tuples(
    st.floats(0.001, 0.5),  # base, seconds
    st.floats(1e-6, 1e-3),  # prefill, seconds per token
)


def feed(learner: Learner, base: float, rate: float, n: int, rng: random.Random) -> None:
    for _ in range(n):
        tokens = rng.randrange(0, 4000)
        learner.observe(tokens, base + rate * tokens)


def close(value: float, wanted: float, share: float = 0.05) -> bool:
    return math.isclose(value, wanted, rel_tol=share, abs_tol=1e-9)


def test_median_and_cold_start() -> None:
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert median([4.0, 1.0, 2.0, 3.0]) == 2.5
    learner = Learner()
    assert learner.rates.cold
    assert (learner.rates.base_s, learner.rates.prefill_s) == (PRIOR_BASE_S, PRIOR_PREFILL_S)
    assert Learner(prior_prefill_s=0.001).rates.prefill_s == 0.001
    assert Learner(prior_prefill_s=-1).rates.prefill_s == PRIOR_PREFILL_S


@given(speeds, st.integers(0, 2**32))
def test_an_engine_s_figures_are_learnt_from_clean_observations(
    speed: tuple[float, float], seed: int
) -> None:
    base, rate = speed
    learner = Learner()
    feed(learner, base, rate, MIN_SAMPLES + 2, random.Random(seed))
    rates = learner.rates
    assert not rates.cold
    assert close(rates.prefill_s, rate) and close(rates.base_s, base)


@given(speeds, st.floats(1.5, 20.0), st.integers(0, 2**32))
@settings(max_examples=50)
def test_a_slowed_engine_is_followed_within_the_window(
    speed: tuple[float, float], factor: float, seed: int
) -> None:
    base, rate = speed
    rng = random.Random(seed)
    learner = Learner()
    feed(learner, base, rate, WINDOW, rng)
    feed(learner, base * factor, rate * factor, WINDOW, rng)
    rates = learner.rates
    assert close(rates.prefill_s, rate * factor) and close(rates.base_s, base * factor)


@given(speeds, st.one_of(st.floats(1.5, 20.0), st.floats(0.05, 0.6)), st.integers(0, 2**32))
@settings(max_examples=80)
def test_a_changed_engine_is_followed_within_a_few_observations(
    speed: tuple[float, float], factor: float, seed: int
) -> None:
    """Slowed (or sped up) by a factor: CHANGE_RUN observations in a row far off the fit
    restart the window, and a couple more pin both figures."""
    base, rate = speed
    rng = random.Random(seed)
    learner = Learner()
    feed(learner, base, rate, WINDOW, rng)
    feed(learner, base * factor, rate * factor, CHANGE_RUN, rng)
    rates = learner.rates
    assert close(rates.prefill_s, rate * factor) and close(rates.base_s, base * factor)


@given(speeds, st.floats(0.0, 100.0), st.integers(0, 4000), st.integers(0, 2**32))
def test_a_single_outlier_barely_moves_the_figures(
    speed: tuple[float, float], outlier: float, tokens: int, seed: int
) -> None:
    base, rate = speed
    learner = Learner()
    rng = random.Random(seed)
    feed(learner, base, rate, WINDOW, rng)
    learner.observe(tokens, outlier)
    rates = learner.rates
    assert close(rates.prefill_s, rate, 0.1) and close(rates.base_s, base, 0.1)


def test_one_prompt_length_keeps_the_prior_slope() -> None:
    learner = Learner(prior_prefill_s=0.0002)
    for _ in range(10):
        learner.observe(500, 0.2)
    assert learner.rates.prefill_s == 0.0002
    assert close(learner.rates.base_s, 0.2 - 0.0002 * 500)
    learner.prior(0.0001)  # the engine's own throughput moved: still no spread
    assert learner.rates.prefill_s == 0.0001


def test_nonsense_observations_are_ignored() -> None:
    learner = Learner()
    for tokens, ttft in ((-1, 0.1), (10, -0.1), (math.inf, 0.1), (10, math.inf), (10, math.nan)):
        learner.observe(tokens, ttft)
    learner.served(math.nan)
    learner.served(-1)
    assert learner.rates.samples == 0 and learner.rates.service_s is None


@given(st.floats(0.01, 10.0), st.floats(0.0, 1e6))
def test_a_hung_request_moves_the_service_time_boundedly(service: float, hung: float) -> None:
    learner = Learner()
    for _ in range(20):
        learner.served(service)
    learner.served(hung)
    held = learner.rates.service_s
    assert held is not None
    assert service * 0.8 <= held <= service * 1.61


def test_batch_size_is_learnt_when_the_engine_is_full() -> None:
    learner = Learner()
    learner.engine_load(3, 0)
    assert learner.rates.slots is None
    learner.engine_load(4, 2)
    assert learner.rates.slots == 4
    learner.engine_load(None, 3)
    assert learner.rates.slots == 4


def test_a_slope_its_observations_cannot_tell_is_borrowed_from_the_fleet() -> None:
    """Measured on prompts of one length only, an agent kept the prior of 100 us a token
    and lost every long prompt to a measured one, so it was never measured on one (found
    by a new user). It borrows the fleet's fastest measured rate until its own tell."""
    learner = Learner()
    for _ in range(MIN_SAMPLES):
        learner.observe(100.0, 0.012)
    assert not learner.sloped and learner.rates.prefill_s == PRIOR_PREFILL_S
    learner.borrow(0.00002)
    assert math.isclose(learner.rates.prefill_s, 0.00002)
    assert math.isclose(learner.rates.base_s, 0.012 - 0.00002 * 100)
    learner.observe(1100.0, 0.012 + 0.00005 * 1000)  # its own rate shows: 50 us a token
    assert learner.sloped and math.isclose(learner.rates.prefill_s, 0.00005)
    learner.borrow(0.00001)
    assert math.isclose(learner.rates.prefill_s, 0.00005)  # its own, not the fleet's
    # An engine's own reported throughput comes before what the fleet lends.
    told = Learner(prior_prefill_s=0.00003)
    told.observe(100.0, 0.01)
    told.borrow(0.00001)
    assert told.rates.prefill_s == 0.00003


def test_a_stale_agent_answering_faster_than_its_figures_starts_afresh() -> None:
    """A stale agent was not chosen because it looked slow: its first answer after that,
    10% or more under the fit, is a recovery, and the old window goes."""
    for answered, afresh in [(0.85, True), (0.95, False), (1.2, False), (1.3, True)]:
        learner = Learner()
        for n in range(8):
            learner.observe(100.0 * n, 0.05 + 0.0001 * 100 * n, now=1.0)
        before = learner.rates
        tokens = 300.0
        predicted = before.base_s + before.prefill_s * tokens
        learner.observe(tokens, answered * predicted, now=1.0 + STALE_S + 1)
        assert (learner.rates.samples == 1) is afresh, answered
