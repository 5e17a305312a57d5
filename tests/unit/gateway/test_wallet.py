"""The wallet stage over a real ledger: refusals, the charge from reported or metered usage,
the hold given back on every ending, fail-open, and the start-time price check."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from decimal import Decimal
from pathlib import Path

import pytest

from hivenet_router.auth.providers import Principal
from hivenet_router.domain.answer import Answer, Outcome, Whole
from hivenet_router.domain.errors import ApiError, ErrorCode
from hivenet_router.domain.request import RequestFacts
from hivenet_router.domain.usage import input_estimate
from hivenet_router.gateway.blocks import PRICES
from hivenet_router.gateway.cache import BILLED
from hivenet_router.gateway.ledger import HoldResult, Ledger
from hivenet_router.gateway.settings import Price, Prices
from hivenet_router.gateway.wallet import CHARGED, WalletStage, worst_case
from hivenet_router.observability.events import Observers
from hivenet_router.pipeline.stage import Next
from hivenet_router.pipeline.ticket import Ticket
from hivenet_router.policy.document import BUILT_IN, Policy
from tests.postgres import Postgres

# 0.001 per input token, 0.002 per output token
PRICE = Price(Decimal(1000), Decimal(2000))
PRICED = dataclasses.replace(BUILT_IN, name="priced").with_block(PRICES, Prices("USD", PRICE))
USAGE = b'{"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 5}}'


pytestmark = pytest.mark.usefixtures("_connect_reads")


@pytest.fixture
async def ledger(server: Postgres, tmp_path: Path) -> AsyncIterator[Ledger]:
    ledger = Ledger(server.database(), tmp_path, 2.0)
    task = asyncio.create_task(ledger.run())
    async with asyncio.timeout(10):
        while not ledger.up:
            await asyncio.sleep(0.02)
    yield ledger
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await ledger.close()


def ticket(tenant: str = "acme", route: str = "/v1/chat/completions") -> Ticket:
    t = Ticket("5c1d2a3b-0000-4000-8000-000000000001", route, 0.0, Observers())
    t.principal = Principal(tenant, "k1", "n", frozenset())
    t.facts = RequestFacts(route, "m", "llm", False, 100, text_bytes=32, messages=1)
    return t


class Wallet(WalletStage):
    """The stage as a request meets it: with the model's policy already on the ticket (the
    handlers resolve it before the first stage)."""

    def __init__(self, policy: Policy, ledger: Ledger) -> None:
        super().__init__(ledger)
        self.policy = policy

    async def __call__(self, ticket: Ticket, next: Next) -> Answer:
        ticket.policy = self.policy
        return await super().__call__(ticket, next)


def charged(t: Ticket) -> Decimal | None:
    """What the audit record says the wallet was charged."""
    value = t.noted(CHARGED)
    return None if value is None else Decimal(value)


def whole(body: bytes = USAGE, status: int = 200) -> Next:
    async def next(t: Ticket) -> Answer:
        return Answer(status, [], Whole(), body=body)

    return next


class Chunks:
    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks

    async def read(self) -> bytes | None:
        return self.chunks.pop(0) if self.chunks else None

    def close(self, outcome: Outcome) -> None:
        pass


async def serve(stage: WalletStage, t: Ticket, next: Next, outcome: Outcome = Outcome.OK) -> None:
    answer = await stage(t, next)
    if t.facts is not None:
        answer.input_estimate = input_estimate(t.facts)  # as the relay does
    while await answer.next_chunk() is not None:
        pass
    await answer.close(outcome)
    await stage.ledger.idle(5)


async def test_an_unfunded_tenant_is_refused_with_402(ledger: Ledger) -> None:
    stage = Wallet(PRICED, ledger)
    with pytest.raises(ApiError) as refused:
        await stage(ticket(), whole())
    assert refused.value.code is ErrorCode.INSUFFICIENT_BALANCE
    assert refused.value.http_status == 402
    assert "has no wallet" in refused.value.message
    await ledger.credit("acme", Decimal("0.001"), "USD", None)
    await serve(stage, ticket(), whole())  # funded: served, and now below zero
    with pytest.raises(ApiError, match="no balance left"):
        await stage(ticket(), whole())
    assert ledger.snapshot().refused == {
        "insufficient": 1,
        "no_wallet": 1,
        "currency": 0,
        "no_price": 0,
        "busy": 0,
    }


async def test_a_served_request_is_charged_its_reported_usage_once(ledger: Ledger) -> None:
    await ledger.credit("acme", Decimal(1), "USD", None)
    stage = Wallet(PRICED, ledger)
    t = ticket()
    await serve(stage, t, whole())
    assert charged(t) == Decimal("0.02")  # 10 x 0.001 + 5 x 0.002
    wallet = await ledger.wallet("acme")
    assert wallet is not None and (wallet.balance, wallet.held) == (Decimal("0.98"), 0)
    rows = await ledger.entries("acme", 10, None)
    first = rows[0]
    assert (first["kind"], first["input_tokens"], first["output_tokens"]) == ("charge", 10, 5)
    assert (await ledger.reconcile()).ok


async def test_a_failed_request_gives_its_hold_back_without_a_charge(ledger: Ledger) -> None:
    await ledger.credit("acme", Decimal(1), "USD", None)
    stage = Wallet(PRICED, ledger)

    async def failing(t: Ticket) -> Answer:
        wallet = await ledger.wallet("acme")
        assert wallet is not None and wallet.held == worst_case(PRICE, t.facts)  # type: ignore[arg-type]
        raise ApiError(ErrorCode.NO_CAPACITY, "full")

    with pytest.raises(ApiError, match="full"):
        await stage(ticket(), failing)
    await ledger.idle(5)
    wallet = await ledger.wallet("acme")
    assert wallet is not None and (wallet.balance, wallet.held) == (1, 0)
    assert len(await ledger.entries("acme", 10, None)) == 1  # the credit only


async def test_a_stream_without_usage_is_charged_what_was_metered(ledger: Ledger) -> None:
    await ledger.credit("acme", Decimal(1), "USD", None)
    stage = Wallet(PRICED, ledger)
    event = b'data: {"choices": [{"delta": {"content": "x"}}]}\n\n'

    async def streaming(t: Ticket) -> Answer:
        return Answer(200, [], Chunks([event, event, b"data: [DONE]\n\n"]), first=event)

    t = ticket()
    await serve(stage, t, streaming, Outcome.CLIENT_GONE)
    # input estimated (32 bytes / 3.2 + 4 = 14 tokens, as the relay sets it), output
    # counted from the text relayed: 3 bytes at 4 a token is 1, not one per data line
    assert charged(t) == Decimal("0.014") + Decimal("0.002")


async def test_a_stream_cut_before_its_last_usage_is_charged_what_the_client_was_sent(
    ledger: Ledger,
) -> None:
    await ledger.credit("acme", Decimal(1), "USD", None)
    stage = Wallet(PRICED, ledger)
    start = (
        b'event: message_start\ndata: {"type": "message_start", "message":'
        b' {"usage": {"input_tokens": 25, "output_tokens": 1}}}\n\n'
    )
    delta = (
        b'event: content_block_delta\ndata: {"type": "content_block_delta", "delta":'
        b' {"type": "text_delta", "text": "abcd"}}\n\n'
    )

    async def anthropic(t: Ticket) -> Answer:
        return Answer(200, [], Chunks([delta] * 50), first=start)

    t = ticket(route="/v1/messages")
    # The client hangs up before message_delta, which would have carried the output count.
    await serve(stage, t, anthropic, Outcome.CLIENT_GONE)
    # 25 input tokens as reported; output counted from the 50 deltas of 4 bytes it was sent
    assert charged(t) == Decimal("0.025") + 50 * Decimal("0.002")


async def test_error_answers_and_unbilled_cache_hits_cost_nothing(ledger: Ledger) -> None:
    await ledger.credit("acme", Decimal(1), "USD", None)
    stage = Wallet(PRICED, ledger)
    failed = ticket()
    await serve(stage, failed, whole(b'{"error": {"message": "bad"}}', status=500))
    hit = ticket()
    hit.put(BILLED, False)
    await serve(stage, hit, whole())
    assert charged(failed) == charged(hit) == 0
    rows = await ledger.entries("acme", 10, None)
    assert [r["kind"] for r in rows] == ["charge", "charge", "credit"]
    wallet = await ledger.wallet("acme")
    assert wallet is not None and (wallet.balance, wallet.held) == (1, 0)


async def test_a_model_without_a_price_is_refused_and_named(
    ledger: Ledger, caplog: pytest.LogCaptureFixture
) -> None:
    stage = Wallet(BUILT_IN, ledger)
    for _ in range(2):
        with pytest.raises(ApiError) as refused:
            await stage(ticket(), whole())
        assert refused.value.code is ErrorCode.BACKEND_UNAVAILABLE
        assert "model m has no price" in refused.value.message
    assert caplog.text.count("has no price in policy built-in") == 1
    assert ledger.snapshot().refused["no_price"] == 2


async def test_a_wallet_in_another_currency_is_refused_naming_both(ledger: Ledger) -> None:
    await ledger.credit("acme", Decimal(5), "EUR", None)
    stage = Wallet(PRICED, ledger)
    with pytest.raises(ApiError, match="in EUR but this model is priced in USD"):
        await stage(ticket(), whole())


async def test_count_tokens_is_free_and_never_checked(ledger: Ledger) -> None:
    stage = Wallet(BUILT_IN, ledger)  # no price, no wallet: still served
    t = ticket(route="/v1/messages/count_tokens")
    await serve(stage, t, whole(b'{"input_tokens": 3}'))
    assert charged(t) is None


async def test_without_its_database_the_stage_fails_open_and_keeps_the_charge(
    tmp_path: Path,
) -> None:
    ledger = Ledger("postgresql://u:p@127.0.0.1:1/db", tmp_path, 0.2)  # never reached
    try:
        stage = Wallet(PRICED, ledger)
        t = ticket(tenant="nobody")
        await serve(stage, t, whole())
        assert charged(t) == Decimal("0.02")
        snapshot = ledger.snapshot()
        assert (snapshot.unbilled, snapshot.pending, snapshot.up) == (1, 1, False)
    finally:
        await ledger.close()


def test_the_worst_case_counts_every_prompt_byte_and_the_declared_output() -> None:
    facts = RequestFacts("/v1/chat/completions", "m", "llm", False, 100, text_bytes=32, messages=2)
    assert worst_case(PRICE, facts) == Decimal("0.04") + Decimal("0.2")
    undeclared = dataclasses.replace(facts, max_output_tokens=None)
    assert worst_case(PRICE, undeclared) == Decimal("0.04") + Decimal("8.192")
    # The policy's default output bound, the one admission forwards to the engine.
    assert worst_case(PRICE, undeclared, 1000) == Decimal("0.04") + Decimal("2")
    embeddings = dataclasses.replace(facts, route="/v1/embeddings")
    assert worst_case(PRICE, embeddings) == Decimal("0.04")


async def test_the_meter_counts_text_not_data_lines(ledger: Ledger) -> None:
    """Text that says "data:" or "[DONE]" is text; an event split across chunks is one."""
    await ledger.credit("acme", Decimal(1), "USD", None)
    stage = Wallet(PRICED, ledger)
    tricky = b'data: {"choices": [{"delta": {"content": "data: x data: [DONE]"}}]}\n\n'
    chunks = [tricky, b"da", b'ta: {"choices": []}\r', b"\n\r\n", b"data: [DO", b"NE]\n\n"]

    async def streaming(t: Ticket) -> Answer:
        return Answer(200, [], Chunks(chunks), first=tricky)

    t = ticket()
    await serve(stage, t, streaming, Outcome.CLIENT_GONE)
    # twice 20 bytes of text (the first chunk is relayed, then read again): 10 tokens
    assert charged(t) == Decimal("0.014") + 10 * Decimal("0.002")


async def test_a_busy_ledger_refuses_with_503_rather_than_let_through(
    ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def busy(*args: object) -> HoldResult:
        return HoldResult("busy")

    monkeypatch.setattr(ledger, "hold", busy)
    stage = Wallet(PRICED, ledger)
    with pytest.raises(ApiError) as refused:
        await stage(ticket(), whole())
    assert refused.value.code is ErrorCode.BACKEND_UNAVAILABLE and "busy" in refused.value.message
    assert ledger.snapshot().refused["busy"] == 1 and ledger.snapshot().unbilled == 0
