"""The policy format as a JSON Schema (draft 2020-12), built from the same tables the
loader validates with, so editors and the router agree."""

from __future__ import annotations

from typing import Any

from hivenet_router.policy.document import MATCH_FIELDS, MODES, PROVIDERS
from hivenet_router.policy.gates import OPERATORS
from hivenet_router.policy.plugins import STRATEGIES
from hivenet_router.policy.signals import SHED_SIGNALS, SIGNALS


def policy_schema() -> dict[str, Any]:
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
    step = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1},
            "match": {
                "type": "object",
                "properties": {
                    **{f: {"type": "string"} for f in MATCH_FIELDS},
                    "tags": {"type": "array", "items": {"type": "string", "minLength": 1}},
                },
                "additionalProperties": False,
            },
            "exclude_if": gates(tuple(SIGNALS)),
            "strategy": {"enum": list(STRATEGIES)},
            "max_tries": count,
        },
        "required": ["strategy"],
        "additionalProperties": False,
    }
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "https://hivenet-router.invalid/policy.schema.json",
        "title": "Hivenet Router routing policy",
        "type": "object",
        "$defs": {"rule": rule, "step": step},
        "properties": {
            "models": {"type": "array", "items": {"type": "string", "minLength": 1}},
            "mode": {"enum": list(MODES)},
            "max_input_tokens": count,
            "images_max": count,
            "admit_budget_tokens": count,
            "max_inflight": count,
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
        },
        "required": ["routing_policy"],
        "additionalProperties": False,
    }
