"""The gateway's policy blocks: what each reads from a policy document, the mistakes each
refuses with file, line and field, and which policies serve a model without a price (the
router's start-time check)."""

from __future__ import annotations

import dataclasses
from decimal import Decimal

import pytest

from hivenet_router.gateway.blocks import CACHE, GATEWAY_BLOCKS, PRICES, VALIDATOR, missing_prices
from hivenet_router.gateway.settings import CacheSettings, Price, Prices, ValidatorSettings
from hivenet_router.policy.document import BUILT_IN, Policy, parse_policy
from hivenet_router.policy.reader import PolicyError

PRICE = Price(Decimal(1000), Decimal(2000))
PRICED = dataclasses.replace(BUILT_IN, name="priced").with_block(PRICES, Prices("USD", PRICE))
ROUTING = "routing_policy: {strategy: least-loaded}\n"


def parse(text: str) -> Policy:
    return parse_policy(ROUTING + text, "p.yaml", "p", require_models=False, blocks=GATEWAY_BLOCKS)


def test_missing_prices_names_policies_and_their_unpriced_models() -> None:
    named = dataclasses.replace(BUILT_IN, name="chat", models=("a", "b", "c")).with_block(
        PRICES, Prices("USD", None, (("a", PRICE),))
    )
    unpriced = dataclasses.replace(BUILT_IN, name="embed", models=("e",))
    assert missing_prices([PRICED, named, unpriced]) == ["chat: b, c", "embed: e"]
    assert missing_prices([BUILT_IN]) == [
        "built-in (the default: every model no other policy names)"
    ]
    everything = named.with_block(PRICES, Prices("USD", PRICE))
    assert missing_prices([PRICED, everything]) == []


def test_a_policy_without_the_blocks_leaves_the_stages_off() -> None:
    policy = parse("")
    assert (policy.block(PRICES), policy.block(CACHE), policy.block(VALIDATOR)) == (None,) * 3
    assert BUILT_IN.block(CACHE) is None


def test_each_block_reads_its_values() -> None:
    policy = parse(
        "prices:\n  currency: EUR\n  input_per_million: 1.5\n  output_per_million: 2\n"
        "  models:\n    big: {input_per_million: 3, output_per_million: 4}\n"
        "response_cache: {ttl_seconds: 5, store: false}\n"
        "stream_validator:\n"
    )
    prices = policy.block(PRICES)
    assert prices == Prices(
        "EUR",
        Price(Decimal("1.5"), Decimal(2)),
        (("big", Price(Decimal(3), Decimal(4))),),
    )
    assert policy.block(CACHE) == CacheSettings(ttl_seconds=5.0, store=False)
    assert policy.block(VALIDATOR) == ValidatorSettings()  # the key alone: every default


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        (
            "prices: {currency: XXX, input_per_million: 1, output_per_million: 2}\n",
            "p.yaml:2: prices.currency: unknown currency",
        ),
        ("prices: {input_per_million: 1}\n", "p.yaml:2: prices.output_per_million: is required"),
        ("prices: {}\n", "p.yaml:2: prices: names no price"),
        (
            "prices:\n  models:\n    a: {input_per_million: -1, output_per_million: 2}\n",
            "p.yaml:4: prices.models.a.input_per_million: must be a non-negative number",
        ),
        (
            "response_cache: {store: false, dedup: false}\n",
            "p.yaml:2: response_cache.store: store and dedup are both off",
        ),
        (
            "response_cache:\n  ttl_seconds: 0\n",
            "p.yaml:3: response_cache.ttl_seconds: must be between 0.001 and",
        ),
        ("response_cache: {colour: red}\n", "p.yaml:2: response_cache.colour: unknown field"),
        (
            "stream_validator: {hold_chunks: 0}\n",
            "p.yaml:2: stream_validator.hold_chunks: must be between 1 and 10000",
        ),
        (
            "stream_validator: {after_hold: 1}\n",
            "p.yaml:2: stream_validator.after_hold: must be true or false",
        ),
        # Parsed in the blocks' order, whatever the document's.
        ("stream_validator: {ngram: 0}\nprices: {}\n", "p.yaml:3: prices: names no price"),
    ],
)
def test_mistakes_name_file_line_and_field(text: str, needle: str) -> None:
    with pytest.raises(PolicyError, match=needle.replace(".", r"\.")):
        parse(text)


def test_a_loader_without_the_blocks_refuses_their_keys() -> None:
    with pytest.raises(PolicyError, match=r"p\.yaml:2: policy\.prices: unknown field"):
        parse_policy(ROUTING + "prices: {}\n", "p.yaml", "p", require_models=False)


def test_the_schema_describes_each_block() -> None:
    cache = CACHE.schema()
    assert cache["type"] == ["object", "null"]
    assert cache["properties"] == {
        **{
            name: {"type": "boolean"}
            for name in ("store", "dedup", "repeatable_only", "shared", "bill_hits")
        },
        "ttl_seconds": {"type": "number", "minimum": 0.001, "maximum": 30 * 86400.0},
        "max_entries": {"type": "integer", "minimum": 1, "maximum": 10_000_000},
        "max_bytes": {"type": "integer", "minimum": 1024, "maximum": 1 << 40},
        "max_entry_bytes": {"type": "integer", "minimum": 1024, "maximum": 1 << 32},
    }
    assert "USD" in PRICES.schema()["properties"]["currency"]["enum"]  # type: ignore[index]
