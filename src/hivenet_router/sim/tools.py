"""Tool calls and structured output, as an engine with a tool parser would answer them.

The simulator calls a tool only when the request forces one (OpenAI `tool_choice:
"required"` or a named function, Anthropic `{"type": "any"}` or a named tool); with `auto`
it answers in text, so an agent loop that sends a tool result back gets a text answer.
Arguments, and answers under `response_format`, are built from the JSON schema the client
sent: required properties with placeholder values of the declared types.
"""

from __future__ import annotations

from typing import Any

import orjson

_MAX_DEPTH = 6


def example(schema: Any, depth: int = 0) -> Any:
    """A small value that satisfies the common parts of a JSON schema."""
    if not isinstance(schema, dict) or depth > _MAX_DEPTH:
        return None
    if "const" in schema:
        return schema["const"]
    enum = schema.get("enum")
    if isinstance(enum, list) and enum:
        return enum[0]
    for key in ("anyOf", "oneOf", "allOf"):
        options = schema.get(key)
        if isinstance(options, list) and options:
            return example(options[0], depth + 1)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind == "object" or (kind is None and "properties" in schema):
        props = schema.get("properties")
        props = props if isinstance(props, dict) else {}
        required = schema.get("required")
        names = required if isinstance(required, list) else []
        return {str(n): example(props.get(n), depth + 1) for n in names}
    if kind == "array":
        least = schema.get("minItems")
        count = least if isinstance(least, int) and 0 < least <= 3 else 0
        return [example(schema.get("items"), depth + 1) for _ in range(count)]
    if kind == "integer":
        low = schema.get("minimum")
        return low if isinstance(low, int) else 1
    if kind == "number":
        low = schema.get("minimum")
        return low if isinstance(low, int | float) else 1.0
    if kind == "boolean":
        return True
    if kind == "null":
        return None
    return "sim"


def _openai_tools(body: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    tools = body.get("tools")
    for tool in tools if isinstance(tools, list) else []:
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            out[function["name"]] = function.get("parameters")
    return out


def _anthropic_tools(body: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    tools = body.get("tools")
    for tool in tools if isinstance(tools, list) else []:
        if isinstance(tool, dict) and isinstance(tool.get("name"), str):
            out[tool["name"]] = tool.get("input_schema")
    return out


def forced_call(body: dict[str, Any], anthropic: bool) -> tuple[str, bytes] | None:
    """The tool the request forces, and its JSON arguments; None for a text answer."""
    tools = _anthropic_tools(body) if anthropic else _openai_tools(body)
    if not tools:
        return None
    choice = body.get("tool_choice")
    name: str | None = None
    if anthropic and isinstance(choice, dict):
        if choice.get("type") == "any":
            name = next(iter(tools))
        elif choice.get("type") == "tool":
            name = choice.get("name") if isinstance(choice.get("name"), str) else None
    elif not anthropic:
        if choice == "required":
            name = next(iter(tools))
        elif isinstance(choice, dict):
            function = choice.get("function")
            if isinstance(function, dict) and isinstance(function.get("name"), str):
                name = function["name"]
    if name is None or name not in tools:
        return None
    return name, orjson.dumps(example(tools[name]) or {})


def structured(body: dict[str, Any]) -> bytes | None:
    """The JSON text to answer with when `response_format` asks for JSON."""
    fmt = body.get("response_format")
    if not isinstance(fmt, dict):
        return None
    if fmt.get("type") == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        return orjson.dumps(example(schema) if schema is not None else {})
    if fmt.get("type") == "json_object":
        return b'{"answer": "sim"}'
    return None


def pieces(text: bytes, size: int = 8) -> list[str]:
    """Split JSON text into stream-sized pieces (each counted as one token)."""
    decoded = text.decode()
    return [decoded[i : i + size] for i in range(0, len(decoded), size)] or [""]
