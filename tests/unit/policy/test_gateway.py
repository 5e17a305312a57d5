"""The policy's gateway blocks as the router's start reads them: which policies serve a
model without a price."""

from __future__ import annotations

import dataclasses
from decimal import Decimal

from hivenet_router.gateway.settings import Price, Prices
from hivenet_router.policy.document import BUILT_IN
from hivenet_router.policy.gateway import missing_prices

PRICE = Price(Decimal(1000), Decimal(2000))
PRICED = dataclasses.replace(BUILT_IN, name="priced", prices=Prices("USD", PRICE))


def test_missing_prices_names_policies_and_their_unpriced_models() -> None:
    named = dataclasses.replace(
        BUILT_IN,
        name="chat",
        models=("a", "b", "c"),
        prices=Prices("USD", None, (("a", PRICE),)),
    )
    unpriced = dataclasses.replace(BUILT_IN, name="embed", models=("e",))
    assert missing_prices([PRICED, named, unpriced]) == ["chat: b, c", "embed: e"]
    assert missing_prices([BUILT_IN]) == [
        "built-in (the default: every model no other policy names)"
    ]
    everything = dataclasses.replace(named, prices=Prices("USD", PRICE))
    assert missing_prices([PRICED, everything]) == []
