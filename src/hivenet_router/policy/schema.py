"""The policy format as a JSON Schema (draft 2020-12), built from the same tables the
loader validates with, so editors and the router agree.

Routing's fields are described here; each block handed in (`policy/blocks.py`) describes
its own, appended in the order given (docs/policy.schema.json is built with the router's
blocks by scripts/gen_policy_schema.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hivenet_router.policy.blocks import Block
from hivenet_router.policy.document import MATCH_FIELDS, MODES, PROVIDERS
from hivenet_router.policy.gates import OPERATORS
from hivenet_router.policy.options import HASH_KEYS, MAX_TEMPERATURE, MAX_WEIGHT
from hivenet_router.policy.signals import SHED_SIGNALS, SIGNALS
from hivenet_router.policy.strategies import NAMES, PRESETS, SCORERS
from hivenet_router.routing import breaker, vegas


def _settings(ranges: Any, open_bounds: Any, ints: frozenset[str]) -> dict[str, Any]:
    properties: dict[str, Any] = {"enabled": {"type": "boolean"}}
    for name, (low, high) in ranges.items():
        above, below = open_bounds.get(name, (False, False))
        prop: dict[str, Any] = {"type": "integer" if name in ints else "number"}
        prop["exclusiveMinimum" if above else "minimum"] = low
        prop["exclusiveMaximum" if below else "maximum"] = high
        properties[name] = prop
    return {"type": "object", "properties": properties, "additionalProperties": False}


def _options() -> dict[str, Any]:
    closed = {"type": "object", "additionalProperties": False}
    return {
        "affinity": {
            **closed,
            "properties": {
                "min_match": {"type": "number", "minimum": 0, "maximum": 1},
                "max_imbalance": {"type": "integer", "minimum": 0, "maximum": 100000},
            },
        },
        "prediction": {
            **closed,
            "properties": {
                "max_imbalance": {"type": "integer", "minimum": 0, "maximum": 100000},
                "ttft_objective_ms": {
                    "type": "number",
                    "exclusiveMinimum": 0,
                    "maximum": 3600000,
                },
            },
        },
        "hash": {
            **closed,
            "properties": {
                "key": {"enum": list(HASH_KEYS)},
                "header": {"type": "string", "pattern": "^[A-Za-z0-9_-]+$"},
                "load_factor": {"type": "number", "minimum": 1, "maximum": 100},
            },
        },
        "scoring": {
            **closed,
            "properties": {
                "preset": {"enum": list(PRESETS)},
                "weights": {
                    **closed,
                    "properties": {
                        name: {"type": "number", "minimum": 0, "maximum": MAX_WEIGHT}
                        for name in SCORERS
                    },
                },
                "temperature": {
                    "type": "number",
                    "exclusiveMinimum": 0,
                    "maximum": MAX_TEMPERATURE,
                },
                "costs": {
                    "type": "array",
                    "items": {
                        **closed,
                        "properties": {
                            "match": {"$ref": "#/$defs/match"},
                            "usd_per_million_tokens": {"type": "number", "minimum": 0},
                        },
                        "required": ["usd_per_million_tokens"],
                    },
                },
            },
        },
    }


def policy_schema(blocks: Sequence[Block[Any]] = ()) -> dict[str, Any]:
    rule = {
        "type": "object",
        "properties": {op: {"type": "number"} for op in OPERATORS},
        "additionalProperties": False,
        "minProperties": 1,
        "maxProperties": 1,
    }

    def gates(signals: tuple[str, ...]) -> dict[str, Any]:
        return {
            "type": "object",
            "properties": {signal: {"$ref": "#/$defs/rule"} for signal in signals},
            "additionalProperties": False,
        }

    count = {"type": "integer", "minimum": 0}
    match = {
        "type": "object",
        "properties": {
            **{f: {"type": "string"} for f in MATCH_FIELDS},
            "tags": {"type": "array", "items": {"type": "string", "minLength": 1}},
        },
        "additionalProperties": False,
    }
    step = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1},
            "match": {"$ref": "#/$defs/match"},
            "exclude_if": gates(tuple(SIGNALS)),
            "strategy": {"enum": list(NAMES)},
            "max_tries": count,
            **_options(),
        },
        "required": ["strategy"],
        "additionalProperties": False,
    }
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "https://hivenet-router.invalid/policy.schema.json",
        "title": "Hivenet Router routing policy",
        "type": "object",
        "$defs": {"rule": rule, "step": step, "match": match},
        "properties": {
            "models": {"type": "array", "items": {"type": "string", "minLength": 1}},
            "mode": {"enum": list(MODES)},
            "max_input_tokens": count,
            "images_max": count,
            "admit_budget_tokens": count,
            "max_inflight": count,
            "default_max_tokens": count,
            "min_output_tokens": count,
            "shed_if": gates(SHED_SIGNALS),
            "routing_policy": {"$ref": "#/$defs/step"},
            "fallback_chain": {"type": "array", "items": {"$ref": "#/$defs/step"}, "minItems": 1},
            "fallback_provider": {
                "type": "object",
                "properties": {
                    "engine": {"enum": list(PROVIDERS)},
                    "model": {"type": "string", "minLength": 1},
                },
                "required": ["engine", "model"],
                "additionalProperties": False,
            },
            "circuit_breaker": _settings(
                breaker.RANGES,
                breaker.OPEN_BOUNDS,
                frozenset({"consecutive_failures", "window", "min_requests", "half_open_probes"}),
            ),
            "adaptive_concurrency": _settings(
                vegas.RANGES, vegas.OPEN_BOUNDS, frozenset({"initial_limit", "rebase_samples"})
            ),
            **{block.name: block.schema() for block in blocks},
        },
        "required": ["routing_policy"],
        "additionalProperties": False,
    }
