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
from hivenet_router.policy import options as step_options

if TYPE_CHECKING:
    from hivenet_router.policy.document import _Reader

BLOCKS = ("prices", "response_cache", "stream_validator")
_PRICE_FIELDS = ("input_per_million", "output_per_million")


def _price(reader: _Reader, node: yaml.Node, path: str, items: dict[str, yaml.Node]) -> Price:
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


def prices(reader: _Reader, node: yaml.Node) -> Prices:
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


def blocks(reader: _Reader, items: dict[str, yaml.Node]) -> dict[str, Any]:
    """The Policy fields the gateway blocks present in `items` set."""
    out: dict[str, Any] = {}
    if "prices" in items:
        out["prices"] = prices(reader, items["prices"])
    if "response_cache" in items:
        node = items["response_cache"]
        if isinstance(node, yaml.ScalarNode) and node.value in ("", "null", "~"):
            out["response_cache"] = CacheSettings()
        else:
            out["response_cache"] = step_options.settings(
                reader, node, "response_cache", CacheSettings, check_cache
            )
    if "stream_validator" in items:
        node = items["stream_validator"]
        if isinstance(node, yaml.ScalarNode) and node.value in ("", "null", "~"):
            out["stream_validator"] = ValidatorSettings()
        else:
            out["stream_validator"] = step_options.settings(
                reader, node, "stream_validator", ValidatorSettings, check_validator
            )
    return out
