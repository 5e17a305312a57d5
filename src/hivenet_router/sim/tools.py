"""Tool calls and structured output, as an engine with a tool parser would answer them.

The simulator calls a tool when the request forces one (OpenAI `tool_choice: "required"`
or a named function, Anthropic `{"type": "any"}` or a named tool), or, with `auto`, when
the conversation ends with a user message that says `[call:NAME]` for one of its tools (so
a client that never forces a tool, such as Codex CLI, can be tested through a tool turn).
Otherwise it answers in text, so an agent loop that sends a tool result back gets a text
answer.
Arguments, and structured answers (OpenAI `response_format`, Anthropic `output_format` or
`output_config.format`), are instances of the JSON schema the client sent
(`schema_answer.instance`), so a client that validates them accepts them.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from hivenet_router.sim.schema_answer import instance

_ECHO = 200  # characters of the prompt a json_object answer echoes
_CALL = re.compile(r"\[call:([A-Za-z0-9_.\-]{1,64})\]")


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
    automatic = choice in (None, "auto") or (
        isinstance(choice, dict) and choice.get("type") == "auto"
    )
    if name is None and automatic:
        name = _prompted(body)
    if name is None or name not in tools:
        return None
    arguments = instance(tools[name]) if tools[name] is not None else {}
    return name, orjson.dumps(arguments if isinstance(arguments, dict) else {})


def structured(body: dict[str, Any]) -> bytes | None:
    """The JSON text to answer with when the request asks for JSON: OpenAI's
    `response_format` (`json_schema`, `json_object`), Anthropic's `output_format` or
    `output_config.format` (`json_schema`)."""
    fmt = body.get("response_format")
    if isinstance(fmt, dict):
        if fmt.get("type") == "json_schema":
            spec = fmt.get("json_schema")
            return _instance(spec.get("schema") if isinstance(spec, dict) else None)
        if fmt.get("type") == "json_object":
            return orjson.dumps({"answer": "sim", "prompt": _last_user_text(body)[:_ECHO]})
        return None
    config = body.get("output_config")
    fmt = body.get("output_format")
    if isinstance(config, dict) and isinstance(config.get("format"), dict):
        fmt = config["format"]
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        return _instance(fmt.get("schema"))
    return None


def _instance(schema: Any) -> bytes:
    return orjson.dumps(instance(schema) if schema is not None else {})


def _prompted(body: dict[str, Any]) -> str | None:
    """The tool a conversation's last message asks for with `[call:NAME]`, when that message
    is the user's own (not a tool's result). System messages after it do not count: Claude
    Code ends its messages with one."""
    messages = body.get("messages")
    turns = [
        m
        for m in (messages if isinstance(messages, list) else [])
        if not (isinstance(m, dict) and m.get("role") == "system")
    ]
    last = turns[-1] if turns else None
    if not isinstance(last, dict) or last.get("role") != "user":
        return None
    content = last.get("content")
    if isinstance(content, list):
        if any(isinstance(p, dict) and p.get("type") == "tool_result" for p in content):
            return None
        content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
    found = _CALL.search(content) if isinstance(content, str) else None
    return found.group(1) if found else None


def _last_user_text(body: dict[str, Any]) -> str:
    """The text of the last user message (OpenAI or Anthropic shape), for an answer that
    echoes it."""
    messages = body.get("messages")
    for message in reversed(messages if isinstance(messages, list) else []):
        if not isinstance(message, dict) or message.get("role") != "user":
            continue
        content = message.get("content")
        if isinstance(content, str):
            return content
        if isinstance(content, list):
            parts = [p.get("text") for p in content if isinstance(p, dict)]
            return " ".join(p for p in parts if isinstance(p, str))
    return ""


def pieces(text: bytes, size: int = 8) -> list[str]:
    """Split JSON text into stream-sized pieces (each counted as one token)."""
    decoded = text.decode()
    return [decoded[i : i + size] for i in range(0, len(decoded), size)] or [""]
