"""Admission's token limits: the output bound (declared times n, or the policy's default,
lowered to what the key can still spend, forwarded to the engine) and the token-rate
buckets that go into debt with exact usage. Time is a ManualClock the tests move."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from hivenet_router.auth.config import Quota
from hivenet_router.domain.answer import Outcome
from hivenet_router.domain.errors import ApiError, ErrorCode
from hivenet_router.state.local import DailyCounter
from tests.unit.router.test_admission import CHAT, ROUTE, Fleet, who

SERVERLESS = "mode: serverless\nrouting_policy: {strategy: least-loaded}\n"


def _usage(prompt: int, completion: int) -> bytes:
    return b'{"usage": {"prompt_tokens": %d, "completion_tokens": %d}}' % (prompt, completion)


async def test_the_output_rate_goes_into_debt_and_refuses_until_the_clock_pays_it() -> None:
    fleet = Fleet(SERVERLESS)
    key = who(Quota(output_tokens_per_minute=100))
    # No max_tokens: the bound is the default (4096) lowered to the 100 the key has left,
    # and it travels to the engine in the body and to the client in a header.
    ticket = fleet.ticket(key, CHAT + b"}")
    fleet.answer_body = _usage(104, 60)
    await (await fleet.send(ticket)).close(Outcome.OK)
    assert ticket.headers_out["X-Hivenet-Output-Bound"] == "100"
    assert ticket.job is not None and b'"max_tokens":100' in ticket.job.body
    assert await fleet.ports.output_rates.left("k1\x00m", 100) == 40
    # An engine that passes the bound puts the key into debt: 40 held, 60 used.
    second = fleet.ticket(key, CHAT + b"}")
    await (await fleet.send(second)).close(Outcome.OK)
    assert second.job is not None and b'"max_tokens":40' in second.job.body
    assert await fleet.ports.output_rates.left("k1\x00m", 100) == -20
    refused = fleet.ticket(key, CHAT + b"}")
    with pytest.raises(ApiError, match="output token rate") as info:
        await fleet.send(refused)
    assert info.value.code is ErrorCode.RATE_LIMIT_EXCEEDED
    # 21 tokens to refill at 100 a minute: 12.6 seconds.
    assert refused.headers_out["Retry-After"] == "13"
    fleet.clock.advance(12)
    with pytest.raises(ApiError, match="output token rate"):
        await fleet.request(key, CHAT + b"}")
    fleet.clock.advance(1)
    fleet.answer_body = _usage(104, 0)
    await (await fleet.request(key, CHAT + b"}")).close(Outcome.OK)
    assert fleet.recorder.refusals() == ["b4_otpm", "b4_otpm"]


async def test_an_unanswered_request_gives_its_output_bound_back() -> None:
    fleet = Fleet(SERVERLESS)
    key = who(Quota(output_tokens_per_minute=100))
    answer = await fleet.send(fleet.ticket(key, CHAT + b', "max_tokens": 30}'), status=500)
    assert await fleet.ports.output_rates.left("k1\x00m", 100) == 70
    await answer.close(Outcome.OK)
    assert await fleet.ports.output_rates.left("k1\x00m", 100) == 100


async def test_the_input_rate_is_trued_up_into_debt_with_exact_usage() -> None:
    fleet = Fleet(SERVERLESS)
    key = who(Quota(input_tokens_per_minute=600))
    fleet.answer_body = _usage(1000, 1)  # the estimate said 104
    await (await fleet.request(key, CHAT + b"}")).close(Outcome.OK)
    assert await fleet.ports.input_rates.left("k1\x00m", 600) == -400
    refused = fleet.ticket(key, CHAT + b"}")
    with pytest.raises(ApiError, match="input token rate"):
        await fleet.send(refused)
    assert refused.facts is not None  # the estimate has learned from the first answer
    estimate = fleet.admission.estimator.estimate("m", refused.facts.text_bytes, 1)
    assert refused.headers_out["Retry-After"] == str(math.ceil((400 + estimate) * 60 / 600))


async def test_min_output_tokens_refuses_with_the_limit_that_lowered_the_bound() -> None:
    fleet = Fleet(SERVERLESS + "min_output_tokens: 50\n")
    key = who(Quota(output_tokens_per_minute=100))
    fleet.answer_body = _usage(104, 60)
    await (await fleet.request(key, CHAT + b"}")).close(Outcome.OK)
    refused = fleet.ticket(key, CHAT + b"}")  # 40 left, 50 needed
    with pytest.raises(ApiError, match="output token rate") as info:
        await fleet.send(refused)
    assert info.value.code is ErrorCode.RATE_LIMIT_EXCEEDED
    assert refused.headers_out["Retry-After"] == "6"
    # A request that asks for less than the minimum needs no more than it asks for: 30
    # fits in the 40 left (found by a new user: it was refused with 429).
    small = fleet.ticket(key, CHAT + b', "max_tokens": 30}')
    fleet.answer_body = _usage(104, 30)
    await (await fleet.send(small)).close(Outcome.OK)
    assert small.headers_out["X-Hivenet-Output-Bound"] == "30"
    # The daily budget lowers only an undeclared bound, and refuses with its own 429.
    daily = Fleet("min_output_tokens: 50\nrouting_policy: {strategy: least-loaded}\n")
    budget = who(Quota(tokens_per_day=300))
    ticket = daily.ticket(budget, CHAT + b"}")
    daily.answer_body = _usage(104, 150)
    await (await daily.send(ticket)).close(Outcome.OK)
    assert ticket.headers_out["X-Hivenet-Output-Bound"] == "196"  # 300 - 104
    assert ticket.job is not None and b'"max_tokens":196' in ticket.job.body
    refused = daily.ticket(budget, CHAT + b"}")
    with pytest.raises(ApiError) as info:
        await daily.send(refused)  # 46 left: not even the input fits
    assert info.value.code is ErrorCode.TOKEN_LIMIT_EXCEEDED
    # What is left is said as the budget's refusal of a declared limit says it, and the
    # message names no field the request did not send (found by a new user).
    assert refused.headers_out["X-RateLimit-Remaining-Tokens"] == "46"
    assert "declares no max_tokens" in info.value.message
    assert daily.recorder.refusals() == ["daily"]


@pytest.mark.parametrize(
    ("route", "body", "held"),
    [
        (ROUTE, CHAT + b', "n": 3, "max_tokens": 100}', 300),
        (ROUTE, CHAT + b', "n": 2, "max_completion_tokens": 70, "max_tokens": 5}', 140),
        (ROUTE, CHAT + b', "n": 4}', 4096),
        ("/v1/completions", b'{"model": "m", "prompt": "hi", "n": 5, "max_tokens": 9}', 45),
        ("/v1/messages", CHAT + b', "max_tokens": 900}', 900),
    ],
)
async def test_every_declared_output_limit_times_n_is_held(
    route: str, body: bytes, held: int
) -> None:
    fleet = Fleet()
    budget = who(Quota(tokens_per_day=1_000_000))
    ticket = fleet.ticket(budget, body, route)
    await fleet.send(ticket)  # held until the answer closes
    assert ticket.facts is not None
    facts = ticket.facts
    estimate = fleet.admission.estimator.estimate("m", facts.text_bytes, facts.messages)
    assert fleet.ports.daily.used("t") == estimate + held  # type: ignore[attr-defined]
    assert ticket.headers_out["X-Hivenet-Output-Bound"] == str(held)


async def test_a_default_bound_read_against_a_stale_budget_is_lowered_not_refused() -> None:
    fleet = Fleet(SERVERLESS + "admit_budget_tokens: 10000\n")

    class Stale(DailyCounter):
        async def left(self, key: str, limit: float) -> float:
            return limit  # another router's spend not seen yet

    daily = Stale(fleet.clock)
    fleet.ports = fleet.admission.ports = dataclasses.replace(fleet.ports, daily=daily)
    await daily.charge("t", 200, 500)
    key = who(Quota(tokens_per_day=500, output_tokens_per_minute=1000), share=1.0)
    ticket = fleet.ticket(key, CHAT + b"}")
    answer = await fleet.send(ticket)
    assert ticket.headers_out["X-Hivenet-Output-Bound"] == "196"  # 300 left - 104
    assert ticket.job is not None and b'"max_tokens":196' in ticket.job.body
    assert daily.used("t") == 500
    assert fleet.ports.shares.held("k1\x00m") == 300  # type: ignore[attr-defined]
    assert await fleet.ports.output_rates.left("k1\x00m", 1000) == 1000 - 196
    await answer.close(Outcome.OK)


async def test_every_choice_gets_a_token_of_the_bound_or_the_request_is_refused() -> None:
    """n = 3,000 without max_tokens on a key with 995 tokens left was held at 995 and sent
    out at one token a choice, 3,000 in all (found by a new user). A bound lowered under
    one token a choice is refused by the limit that lowered it; a default under it is
    raised to it."""
    daily = Fleet("routing_policy: {strategy: least-loaded}\n")
    budget = who(Quota(tokens_per_day=300))
    many = b'{"model": "m", "prompt": ["a", "b", "c", "d"], "n": 100}'  # 400 choices
    with pytest.raises(ApiError) as info:
        await daily.request(budget, many, route="/v1/completions")
    assert info.value.code is ErrorCode.TOKEN_LIMIT_EXCEEDED
    small = Fleet("default_max_tokens: 2\nrouting_policy: {strategy: least-loaded}\n")
    ticket = small.ticket(who(Quota()), CHAT + b', "n": 5}')
    await (await small.send(ticket)).close(Outcome.OK)
    assert ticket.headers_out["X-Hivenet-Output-Bound"] == "5"
    assert ticket.job is not None and b'"max_tokens":1' in ticket.job.body


@pytest.mark.parametrize(
    "limits",
    [
        b'"max_tokens": 5, "n_predict": -1',
        b'"max_completion_tokens": 5, "max_tokens": -1, "n_predict": -1',
        b'"max_tokens": 5, "n_predict": 2.5',
    ],
)
async def test_a_limit_the_router_did_not_count_is_replaced_even_where_the_bound_is_unchanged(
    limits: bytes,
) -> None:
    """`n_predict: -1` beside `max_tokens: 5`: held at 5, but the body went out as it came,
    and llama.cpp read -1 as no limit (found by a new user: 2,035 tokens)."""
    fleet = Fleet("routing_policy: {strategy: least-loaded}\n")
    ticket = fleet.ticket(who(Quota()), CHAT + b", " + limits + b"}")
    await (await fleet.send(ticket)).close(Outcome.OK)
    assert ticket.headers_out["X-Hivenet-Output-Bound"] == "5"
    assert ticket.job is not None
    sent = json.loads(ticket.job.body)
    assert sent["n_predict"] == 5 and sent.get("max_tokens", 5) == 5
