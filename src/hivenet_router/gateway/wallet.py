"""The wallet stage: 402 at or below zero, a hold at admission, a settle at the end.

Before the request goes on, its worst case (the prompt's bytes as tokens, the declared or
default output) is held on the tenant's wallet, if the wallet has anything left; once the
answer is closed, what it cost is charged and the hold released, in one idempotent
transaction (gateway/ledger.py). The ledger failing never fails a request: it goes on
unbilled and its charge waits on local disk (fail-open).

What a request costs: the usage its answer reported, at its model's price in the policy.
An answer that reported none (an engine without `include_usage`, a stream cut short) is
charged what the answer's meter counted (domain/usage.py: the input estimate and the output
counted from the text relayed). An
error answer (status 400 and above) costs nothing; so does an answer a cache served when
its policy does not bill hits. `/v1/messages/count_tokens` is free and never checked;
embeddings and rerank pay for their input only.
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from decimal import Decimal
from typing import Final

from hivenet_router.domain.answer import Answer
from hivenet_router.domain.errors import ApiError, ErrorCode
from hivenet_router.domain.request import RequestFacts, Usage
from hivenet_router.domain.usage import input_estimate
from hivenet_router.gateway.blocks import PRICES
from hivenet_router.gateway.cache import BILLED
from hivenet_router.gateway.ledger import HoldResult, Ledger
from hivenet_router.gateway.pending import Charge
from hivenet_router.gateway.settings import MILLION, Price
from hivenet_router.pipeline.output_bound import OUTPUT_BOUND, apply_bound, least_output
from hivenet_router.pipeline.stage import Next
from hivenet_router.pipeline.ticket import Note, Ticket
from hivenet_router.policy.document import Policy

log = logging.getLogger("hivenet.router")

# Routes that generate tokens (the others pay for their input only), and those never billed.
GENERATING_ROUTES: Final = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/messages"})
FREE_ROUTES: Final = frozenset({"/v1/messages/count_tokens"})
DEFAULT_OUTPUT_TOKENS: Final = 4096  # held when a request declares no max_tokens
MESSAGE_OVERHEAD: Final = 4  # tokens of role and framing per message
IMAGE_TOKENS: Final = 1600  # held per image (a large image in most vision models)
_LOGGED_MODELS_MAX: Final = 1000
# What the tenant's wallet was charged, in the price's currency, on the audit record.
CHARGED: Final = Note[str]("charge", place=20)


def worst_case(
    price: Price, facts: RequestFacts, default_output: int = 0, bound: int = 0
) -> Decimal:
    """The most this request can cost: every prompt byte a token (no tokenizer makes more),
    plus the output bound admission held (`bound`), else the output it declared (times n),
    or the policy's default output bound, or DEFAULT_OUTPUT_TOKENS when the policy has
    none."""
    tokens_in = facts.text_bytes + MESSAGE_OVERHEAD * facts.messages + IMAGE_TOKENS * facts.images
    tokens_out = 0
    if facts.route in GENERATING_ROUTES:
        declared = facts.max_output_tokens
        tokens_out = declared if declared is not None else default_output or DEFAULT_OUTPUT_TOKENS
        tokens_out = bound or tokens_out
    return price.cost(tokens_in, tokens_out)


def affordable_output(price: Price, facts: RequestFacts, available: Decimal) -> int | None:
    """Output tokens `available` pays for after the request's estimated input, or None when
    output is free (nothing to bound)."""
    if price.output_per_million <= 0:
        return None
    spare = available - price.cost(estimated_input(facts), 0)
    return max(0, math.floor(spare * MILLION / price.output_per_million))


def estimated_input(facts: RequestFacts) -> int:
    return input_estimate(facts)


class WalletStage:
    name = "wallet"

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self._unpriced: set[str] = set()  # models already logged as having no price

    async def __call__(self, ticket: Ticket, next: Next) -> Answer:
        facts = ticket.facts
        if facts is None or facts.route in FREE_ROUTES:
            return await next(ticket)
        tenant = ticket.caller.tenant
        price, currency = self._price(ticket.policy, facts.model)
        base = Charge(
            self.ledger.new_charge_id(),
            ticket.request_id,
            tenant,
            currency,
            facts.model,
            Decimal(0),
        )
        held = await self.ledger.hold(
            base.charge_id,
            ticket.request_id,
            tenant,
            currency,
            worst_case(price, facts, ticket.policy.default_max_tokens, ticket.get(OUTPUT_BOUND)),
        )
        if held.refused:
            self.ledger.stats.refused[held.status] += 1
            raise ApiError(ErrorCode.INSUFFICIENT_BALANCE, _refusal(tenant, currency, held))
        if held.status == "busy":
            # A healthy ledger with every connection in use: refused rather than let
            # through unchecked, so that a burst cannot overdraw a wallet.
            self.ledger.stats.refused["busy"] += 1
            raise ApiError(
                ErrorCode.BACKEND_UNAVAILABLE,
                "the wallet ledger is busy and this request's balance could not be checked; "
                "retry shortly",
            )
        if held.unbilled:
            self.ledger.stats.unbilled += 1
        try:
            if held.status == "held" and held.detail:
                self._fit(ticket, facts, price, currency, Decimal(held.detail))
            answer = await next(ticket)
        except BaseException:
            if held.status != "skipped":  # a hold was (or may have been) taken: give it back
                self.ledger.settle_soon(replace(base, record=False))
            raise
        answer.on_close(
            lambda outcome, usage: self._settle(ticket, facts, base, price, answer, usage)
        )
        return answer

    def _fit(
        self, ticket: Ticket, facts: RequestFacts, price: Price, currency: str, available: Decimal
    ) -> None:
        """Lower the output bound admission held to what the balance pays for (the hold
        said what was available); 402 when that is under the policy's min_output_tokens."""
        bound = ticket.get(OUTPUT_BOUND)
        if not bound:
            return
        affordable = affordable_output(price, facts, available)
        if affordable is None or affordable >= bound:
            return
        least = least_output(bound, facts.choices, ticket.policy.min_output_tokens)
        if affordable < least:
            self.ledger.stats.refused["insufficient"] += 1
            raise ApiError(
                ErrorCode.INSUFFICIENT_BALANCE,
                f"tenant {ticket.caller.tenant} has {available} {currency} "
                f"available, which pays for {affordable} output tokens of {facts.model}; "
                f"the policy asks for at least {least}",
            )
        apply_bound(ticket, affordable)

    def _price(self, policy: Policy, model: str) -> tuple[Price, str]:
        prices = policy.block(PRICES)
        price = prices.for_model(model) if prices is not None else None
        if price is None or prices is None:
            self.ledger.stats.refused["no_price"] += 1
            if model not in self._unpriced and len(self._unpriced) < _LOGGED_MODELS_MAX:
                self._unpriced.add(model)
                log.error("wallets: model %s has no price in policy %s", model, policy.name)
            raise ApiError(
                ErrorCode.BACKEND_UNAVAILABLE,
                f"model {model} has no price in its policy ({policy.name}), so it cannot be "
                "billed; the operator must add one",
            )
        return price, prices.currency

    def _settle(
        self,
        ticket: Ticket,
        facts: RequestFacts,
        base: Charge,
        price: Price,
        answer: Answer,
        usage: Usage | None,
    ) -> None:
        """The close hook: work out the cost now (the audit record shows it), write it in the
        background. Runs once, whatever the outcome."""
        if answer.status >= 400:
            tokens_in = tokens_out = 0  # an error answer generated nothing
        elif usage is not None:
            # The answer's one meter (domain/answer.py): reported, or counted from the text
            # of a stream that reported none.
            tokens_in, tokens_out = usage.input_tokens, usage.output_tokens
        else:
            tokens_in, tokens_out = estimated_input(facts), 0
        cost = price.cost(tokens_in, tokens_out) if ticket.get(BILLED) else Decimal(0)
        ticket.note(CHARGED, str(cost))
        self.ledger.settle_soon(
            replace(base, amount=cost, input_tokens=tokens_in, output_tokens=tokens_out)
        )


def _refusal(tenant: str, currency: str, held: HoldResult) -> str:
    if held.status == "no_wallet":
        return f"tenant {tenant} has no wallet; an operator must credit it first"
    if held.status == "currency":
        return (
            f"tenant {tenant}'s wallet is in {held.detail} but this model is priced in "
            f"{currency}; no charge can be taken"
        )
    return (
        f"tenant {tenant} has no balance left ({held.detail} {currency} available: the "
        "balance less what requests still running hold)"
    )
