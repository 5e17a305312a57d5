"""The gateway blocks of a policy document: `prices`, `response_cache`, `stream_validator`."""

from __future__ import annotations

from decimal import Decimal
from typing import TYPE_CHECKING, Any

import yaml

from hivenet_router.gateway.settings import (
    CURRENCIES,
    DEFAULT_CURRENCY,
    CacheSettings,
    Price,
    Prices,
    ValidatorSettings,
    check_cache,
    check_validator,
)

if TYPE_CHECKING:
    from collections.abc import Iterable

    from hivenet_router.policy.document import Policy
    from hivenet_router.policy.reader import Reader

BLOCKS = ("prices", "response_cache", "stream_validator")
_PRICE_FIELDS = ("input_per_million", "output_per_million")


def _price(reader: Reader, node: yaml.Node, path: str, items: dict[str, yaml.Node]) -> Price:
    values: list[Decimal] = []
    for name in _PRICE_FIELDS:
        if name not in items:
            raise reader.fail(node, f"{path}.{name}", "is required")
        raw = reader.scalar(items[name], f"{path}.{name}")
        if isinstance(raw, bool) or not isinstance(raw, int | float):
            raise reader.fail(items[name], f"{path}.{name}", "must be a number")
        value = Decimal(str(raw))
        if not value.is_finite() or value < 0:
            raise reader.fail(items[name], f"{path}.{name}", "must be a non-negative number")
        values.append(value)
    return Price(values[0], values[1])


def prices(reader: Reader, node: yaml.Node) -> Prices:
    items = reader.mapping(node, "prices", ("currency", *_PRICE_FIELDS, "models"))
    currency = DEFAULT_CURRENCY
    if "currency" in items:
        currency = reader.string(items["currency"], "prices.currency")
        if currency not in CURRENCIES:
            raise reader.fail(
                items["currency"], "prices.currency", "unknown currency (an ISO 4217 code: USD)"
            )
    default = None
    if any(name in items for name in _PRICE_FIELDS):
        default = _price(reader, node, "prices", items)
    models: list[tuple[str, Price]] = []
    if "models" in items:
        for name, entry in reader.mapping(items["models"], "prices.models", ()).items():
            where = f"prices.models.{name}"
            models.append(
                (name, _price(reader, entry, where, reader.mapping(entry, where, _PRICE_FIELDS)))
            )
    if default is None and not models:
        raise reader.fail(node, "prices", "names no price (input_per_million, output_per_million)")
    return Prices(currency, default, tuple(models))


def blocks(reader: Reader, items: dict[str, yaml.Node]) -> dict[str, Any]:
    """The Policy fields the gateway blocks present in `items` set."""
    out: dict[str, Any] = {}
    if "prices" in items:
        out["prices"] = prices(reader, items["prices"])
    for block, kind, check in (
        ("response_cache", CacheSettings, check_cache),
        ("stream_validator", ValidatorSettings, check_validator),
    ):
        if block in items:
            out[block] = _switched_on(reader, items[block], block, kind, check)
    return out


def _switched_on(
    reader: Reader, node: yaml.Node, block: str, kind: Any, check: Any
) -> CacheSettings | ValidatorSettings:
    """A settings block; the key alone (no value) takes every default, as `{}` does."""
    if isinstance(node, yaml.ScalarNode) and node.value in ("", "null", "~"):
        made: CacheSettings | ValidatorSettings = kind()
        return made
    settings: CacheSettings | ValidatorSettings = reader.settings(node, block, kind, check)
    return settings


def missing_prices(policies: Iterable[Policy]) -> list[str]:
    """Policies that serve a model without a price, named with those models. A policy that
    names no models (the default) serves every model no other policy names: it needs a
    price for all of them (`input_per_million` and `output_per_million` at the top of its
    `prices` block)."""
    out: list[str] = []
    for policy in policies:
        prices = policy.prices
        if not policy.models:
            if prices is None or prices.default is None:
                out.append(f"{policy.name} (the default: every model no other policy names)")
            continue
        lacking = [m for m in policy.models if prices is None or prices.for_model(m) is None]
        if lacking:
            out.append(f"{policy.name}: {', '.join(lacking)}")
    return out
