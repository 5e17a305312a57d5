"""The gateway's policy blocks: `prices`, `response_cache`, `stream_validator`.

Each is a `Block` (policy/blocks.py) the router hands to the policy store at start
(`router/wiring.py`); the stages read what a model's policy says with `policy.block(...)`:
`PRICES` for the wallet, `CACHE` for the response cache, `VALIDATOR` for the stream
validator. Each is None (the stage does nothing) unless the policy has the block; a
policy's block applies to its own models only, and the default policy's to every model no
named policy claims (nothing is merged between them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields, replace
from decimal import Decimal
from typing import TYPE_CHECKING, Any, Final, Generic, TypeVar

import yaml

from hivenet_router.gateway.settings import (
    CACHE_RANGES,
    CURRENCIES,
    DEFAULT_CURRENCY,
    SYNTAX_ALL,
    SYNTAX_OFF,
    VALIDATOR_RANGES,
    CacheSettings,
    Price,
    Prices,
    SyntaxSettings,
    ValidatorSettings,
    check_cache,
    check_validator,
)

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

    from hivenet_router.policy.blocks import Block
    from hivenet_router.policy.document import Policy
    from hivenet_router.policy.reader import Reader

_PRICE_FIELDS = ("input_per_million", "output_per_million")
S = TypeVar("S", bound="DataclassInstance")


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


@dataclass(frozen=True, slots=True)
class PricesBlock:
    """`prices`: what a million tokens cost for the wallet (a default, per-model overrides)."""

    name: str = "prices"

    def parse(self, reader: Reader, node: yaml.Node, where: str) -> Prices | None:
        items = reader.mapping(node, where, ("currency", *_PRICE_FIELDS, "models"))
        currency = DEFAULT_CURRENCY
        if "currency" in items:
            currency = reader.string(items["currency"], f"{where}.currency")
            if currency not in CURRENCIES:
                raise reader.fail(
                    items["currency"],
                    f"{where}.currency",
                    "unknown currency (an ISO 4217 code: USD)",
                )
        default = None
        if any(name in items for name in _PRICE_FIELDS):
            default = _price(reader, node, where, items)
        models: list[tuple[str, Price]] = []
        if "models" in items:
            for model, entry in reader.mapping(items["models"], f"{where}.models", ()).items():
                at = f"{where}.models.{model}"
                models.append(
                    (model, _price(reader, entry, at, reader.mapping(entry, at, _PRICE_FIELDS)))
                )
        if default is None and not models:
            raise reader.fail(node, where, "names no price (input_per_million, output_per_million)")
        return Prices(currency, default, tuple(models))

    def default(self) -> Prices | None:
        return None

    def schema(self) -> dict[str, object]:
        amount = {"type": "number", "minimum": 0}
        price = {
            "type": "object",
            "properties": {"input_per_million": amount, "output_per_million": amount},
            "required": ["input_per_million", "output_per_million"],
            "additionalProperties": False,
        }
        return {
            "type": "object",
            "properties": {
                "currency": {"enum": sorted(CURRENCIES)},
                "input_per_million": amount,
                "output_per_million": amount,
                "models": {"type": "object", "additionalProperties": price},
            },
            "dependentRequired": {
                "input_per_million": ["output_per_million"],
                "output_per_million": ["input_per_million"],
            },
            "additionalProperties": False,
        }


@dataclass(frozen=True, slots=True)
class SettingsBlock(Generic[S]):
    """A stage's settings block; the key alone (no value) takes every default, as `{}` does."""

    name: str
    kind: type[S]  # a frozen settings dataclass
    check: Callable[[S], str | None]
    ranges: Mapping[str, tuple[float, float]]

    def parse(self, reader: Reader, node: yaml.Node, where: str) -> S | None:
        if isinstance(node, yaml.ScalarNode) and node.value in ("", "null", "~"):
            return self.kind()
        return reader.settings(node, where, self.kind, self.check)

    def default(self) -> S | None:
        return None

    def schema(self) -> dict[str, object]:
        """Its ranged numbers, and its switches as booleans."""
        made = self.kind()
        properties: dict[str, Any] = {}
        for name in (declared.name for declared in fields(made)):
            if name in self.ranges:
                low, high = self.ranges[name]
                integer = isinstance(getattr(made, name), int)
                properties[name] = {
                    "type": "integer" if integer else "number",
                    "minimum": low,
                    "maximum": high,
                }
            else:
                properties[name] = {"type": "boolean"}
        return {"type": ["object", "null"], "properties": properties, "additionalProperties": False}


def _no_check(_: SyntaxSettings) -> str | None:
    return None


@dataclass(frozen=True, slots=True)
class ValidatorBlock:
    """`stream_validator`: the settings block, with `syntax` as a nested mapping of switches
    (or `true`/`false` for all of them, free text included, or none)."""

    name: str = "stream_validator"
    flat: SettingsBlock[ValidatorSettings] = SettingsBlock(
        "stream_validator", ValidatorSettings, check_validator, VALIDATOR_RANGES
    )

    def parse(self, reader: Reader, node: yaml.Node, where: str) -> ValidatorSettings | None:
        syntax: SyntaxSettings | None = None
        if isinstance(node, yaml.MappingNode):
            rest = []
            for key, value in node.value:
                if isinstance(key, yaml.ScalarNode) and key.value == "syntax":
                    syntax = self._syntax(reader, value, f"{where}.syntax")
                else:
                    rest.append((key, value))
            node = yaml.MappingNode(node.tag, rest, node.start_mark, node.end_mark)
        made = self.flat.parse(reader, node, where)
        if made is None or syntax is None:
            return made
        return replace(made, syntax=syntax)

    @staticmethod
    def _syntax(reader: Reader, node: yaml.Node, where: str) -> SyntaxSettings:
        if isinstance(node, yaml.ScalarNode):
            if node.value in ("", "null", "~"):
                return SyntaxSettings()
            value = reader.scalar(node, where)
            if not isinstance(value, bool):
                raise reader.fail(node, where, "must be true, false or a mapping of checks")
            return SYNTAX_ALL if value else SYNTAX_OFF
        return reader.settings(node, where, SyntaxSettings, _no_check)

    def default(self) -> ValidatorSettings | None:
        return None

    def schema(self) -> dict[str, object]:
        made = self.flat.schema()
        switches = {f.name: {"type": "boolean"} for f in fields(SyntaxSettings)}
        syntax = {
            "type": ["object", "boolean", "null"],
            "properties": switches,
            "additionalProperties": False,
        }
        properties = made["properties"]
        assert isinstance(properties, dict)
        properties["syntax"] = syntax
        return made


PRICES: Final = PricesBlock()
CACHE: Final = SettingsBlock("response_cache", CacheSettings, check_cache, CACHE_RANGES)
VALIDATOR: Final = ValidatorBlock()
# In the order they are parsed and published (docs/policy.schema.json).
GATEWAY_BLOCKS: Final[tuple[Block[Any], ...]] = (PRICES, CACHE, VALIDATOR)


def missing_prices(policies: Iterable[Policy]) -> list[str]:
    """Policies that serve a model without a price, named with those models. A policy that
    names no models (the default) serves every model no other policy names: it needs a
    price for all of them (`input_per_million` and `output_per_million` at the top of its
    `prices` block)."""
    out: list[str] = []
    for policy in policies:
        prices = policy.block(PRICES)
        if not policy.models:
            if prices is None or prices.default is None:
                out.append(f"{policy.name} (the default: every model no other policy names)")
            continue
        lacking = [m for m in policy.models if prices is None or prices.for_model(m) is None]
        if lacking:
            out.append(f"{policy.name}: {', '.join(lacking)}")
    return out
