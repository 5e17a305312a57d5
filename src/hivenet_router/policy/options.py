"""Reading a step's strategy options, and the defaults of a policy's breaker and concurrency
settings that follow what was set (the settings themselves are read by `Reader.settings`).

Each value is checked where it is read, so a mistake is refused at start and at reload with
the file, line and field: an unknown scorer, a negative weight, a temperature of zero, a
breaker window of one.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import yaml

from hivenet_router.policy.strategies import PRESETS, SCORERS, CostRule, Options

if TYPE_CHECKING:
    from hivenet_router.policy.document import RoutingReader

# Option blocks a step may carry, and the strategies that read each.
BLOCKS = ("affinity", "hash", "scoring", "prediction")
READERS = {
    "affinity": ("prefix-affinity",),
    "hash": ("consistent-hash",),
    "scoring": ("scored",),
    "prediction": ("predicted-latency",),
}
HASH_KEYS = ("session", "prefix")
MAX_WEIGHT = 1000.0
MAX_TEMPERATURE = 100.0


def parse(reader: RoutingReader, items: dict[str, yaml.Node], path: str, strategy: str) -> Options:
    values: dict[str, Any] = {}
    for block in BLOCKS:
        if block not in items:
            continue
        where = f"{path}.{block}"
        if strategy not in READERS[block]:
            readers = " or ".join(READERS[block])
            raise reader.fail(items[block], where, f"is read only by strategy {readers}")
        values.update(_BLOCK_PARSERS[block](reader, items[block], where))
    return Options(**values)


def _bounded(
    reader: RoutingReader,
    node: yaml.Node,
    path: str,
    low: float,
    high: float,
    *,
    above: bool = False,
) -> float:
    value = reader.number(node, path)
    if math.isnan(value) or value > high or value < low or (above and value <= low):
        floor = f"more than {low:g}" if above else f"at least {low:g}"
        raise reader.fail(node, path, f"must be {floor} and at most {high:g}")
    return value


def _affinity(
    reader: RoutingReader,
    node: yaml.Node,
    path: str,
    known: tuple[str, ...] = ("min_match", "max_imbalance"),
) -> dict[str, Any]:
    fields = reader.mapping(node, path, known)
    out: dict[str, Any] = {}
    if "min_match" in fields:
        out["min_match"] = _bounded(reader, fields["min_match"], f"{path}.min_match", 0.0, 1.0)
    if "max_imbalance" in fields:
        imbalance = reader.count(fields["max_imbalance"], f"{path}.max_imbalance")
        if imbalance > 100_000:
            raise reader.fail(fields["max_imbalance"], f"{path}.max_imbalance", "is too large")
        out["max_imbalance"] = imbalance
    return out


def _hash(reader: RoutingReader, node: yaml.Node, path: str) -> dict[str, Any]:
    fields = reader.mapping(node, path, ("key", "header", "load_factor"))
    out: dict[str, Any] = {}
    if "key" in fields:
        key = reader.string(fields["key"], f"{path}.key")
        if key not in HASH_KEYS:
            raise reader.fail(
                fields["key"], f"{path}.key", f"must be one of {', '.join(HASH_KEYS)}"
            )
        out["hash_key"] = key
    if "header" in fields:
        header = reader.string(fields["header"], f"{path}.header", allow_empty=False)
        if not all(c.isalnum() or c in "-_" for c in header):
            raise reader.fail(fields["header"], f"{path}.header", "is not a header name")
        out["hash_header"] = header.lower()
    if "load_factor" in fields:
        out["load_factor"] = _bounded(
            reader, fields["load_factor"], f"{path}.load_factor", 1.0, 100.0
        )
    return out


def _scoring(reader: RoutingReader, node: yaml.Node, path: str) -> dict[str, Any]:
    fields = reader.mapping(node, path, ("preset", "weights", "temperature", "costs"))
    out: dict[str, Any] = {}
    preset = "load-balanced"
    if "preset" in fields:
        preset = reader.string(fields["preset"], f"{path}.preset")
        if preset not in PRESETS:
            raise reader.fail(
                fields["preset"], f"{path}.preset", f"must be one of {', '.join(PRESETS)}"
            )
        out["preset"] = preset
    if "weights" in fields:
        weights = []
        for name, value in reader.mapping(fields["weights"], f"{path}.weights", ()).items():
            where = f"{path}.weights.{name}"
            if name not in SCORERS:
                raise reader.fail(value, where, f"unknown scorer (known: {', '.join(SCORERS)})")
            weight = reader.number(value, where)
            if not 0.0 <= weight <= MAX_WEIGHT:
                raise reader.fail(value, where, f"must be between 0 and {MAX_WEIGHT:g}")
            weights.append((name, weight))
        out["weights"] = tuple(weights)
        if not any(
            w > 0 for w in Options(preset=preset, weights=out["weights"]).scored_weights().values()
        ):
            raise reader.fail(fields["weights"], f"{path}.weights", "at least one must be positive")
    if "temperature" in fields:
        out["temperature"] = _bounded(
            reader, fields["temperature"], f"{path}.temperature", 0.0, MAX_TEMPERATURE, above=True
        )
    if "costs" in fields:
        out["costs"] = _costs(reader, fields["costs"], f"{path}.costs")
    return out


def _costs(reader: RoutingReader, node: yaml.Node, path: str) -> tuple[CostRule, ...]:
    if not isinstance(node, yaml.SequenceNode):
        raise reader.fail(node, path, "must be a list of {match, usd_per_million_tokens}")
    rules = []
    for index, item in enumerate(node.value):
        where = f"{path}[{index}]"
        fields = reader.mapping(item, where, ("match", "usd_per_million_tokens"))
        if "usd_per_million_tokens" not in fields:
            raise reader.fail(item, f"{where}.usd_per_million_tokens", "is required")
        price = _bounded(
            reader, fields["usd_per_million_tokens"], f"{where}.usd_per_million_tokens", 0, 1e6
        )
        match = reader.match(fields["match"], f"{where}.match") if "match" in fields else None
        rules.append(CostRule(match.fields if match else (), match.tags if match else (), price))
    return tuple(rules)


def _prediction(reader: RoutingReader, node: yaml.Node, path: str) -> dict[str, Any]:
    fields = reader.mapping(node, path, ("max_imbalance", "ttft_objective_ms"))
    out = _affinity(reader, node, path, ("max_imbalance", "ttft_objective_ms"))
    if "ttft_objective_ms" in fields:
        where = f"{path}.ttft_objective_ms"
        out["ttft_objective_ms"] = _bounded(
            reader, fields["ttft_objective_ms"], where, 0.0, 3_600_000.0, above=True
        )
    return out


_BLOCK_PARSERS = {
    "affinity": _affinity,
    "hash": _hash,
    "scoring": _scoring,
    "prediction": _prediction,
}


def complete_breaker(values: dict[str, Any]) -> None:
    """A window set below the default `min_requests` brings that default down with it."""
    window = values.get("window")
    if isinstance(window, int) and "min_requests" not in values:
        values["min_requests"] = max(1, min(window, 10))


def complete_vegas(values: dict[str, Any]) -> None:
    """An `alpha` set at or above the default `beta` moves that default to twice it."""
    alpha = values.get("alpha")
    if isinstance(alpha, float) and "beta" not in values and alpha >= 6.0:
        values["beta"] = 2 * alpha
