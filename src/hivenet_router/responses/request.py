"""Reading a Responses request: the fields the router acts on, checked as the OpenAI
schema types them, with a stable error code naming the field at fault.

Every way a body can be wrong is a 400 before anything reaches an agent: `request_invalid`
for a missing or ill-typed field, `unsupported_tool` for a tool the fleet cannot run (the
hosted tools: web search, file search, code interpreter, computer use, MCP, image
generation, shells), `unsupported_parameter` for a feature the router does not offer
(background responses, conversations, stored prompts, file inputs).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Final

import orjson

from hivenet_router.domain.errors import ApiError, ErrorCode

ROLES: Final = frozenset({"user", "assistant", "system", "developer"})
FORMATS: Final = frozenset({"text", "json_object", "json_schema"})
EFFORTS: Final = frozenset({"none", "minimal", "low", "medium", "high", "xhigh"})
# Refused as `unsupported_parameter` when set to anything but null/false.
_UNSUPPORTED: Final = ("background", "conversation", "prompt")
# The fields whose checks find nothing to check when they are absent, beyond those most
# requests send (model, input, a few numbers): a request with none of them skips them.
_RARE: Final = frozenset(
    {
        *_UNSUPPORTED,
        "parallel_tool_calls",
        "truncation",
        "include",
        "reasoning",
        "text",
        "tools",
        "tool_choice",
        "metadata",
        "top_logprobs",
        "max_tool_calls",
        "prompt_cache_key",
    }
)
# The sampling parameters' ranges, as OpenAI states them.
_RANGES: Final = (("temperature", 2), ("top_p", 1))
VERBOSITIES: Final = frozenset({"low", "medium", "high"})
TOP_LOGPROBS: Final = 20
SUMMARIES: Final = frozenset({"auto", "concise", "detailed"})
METADATA_KEYS: Final = 16
MAX_OUTPUT: Final = 2**31 - 1  # as chat's max_tokens (router/bodies.py)


# An ID is `{prefix}_` and 48 hex digits, as `secrets.token_hex(24)` writes them: the
# first 12 the time in milliseconds, the other 36 random (144 bits, as unguessable as a
# secret token needs). The time first puts the store's new rows beside each other in the
# index of its primary key: with random IDs every stored Response dirtied a page of that
# index of its own, which cost the store's thread 19 against 12 us a row with 20,000 rows
# stored and 26 against 12 with 150,000 (docs/benchmarks.md, "Time-ordered IDs").
# The random parts are fetched from os.urandom 256 at a time. A request makes three or
# more IDs, and each os.urandom call releases the GIL: with the store's thread busy,
# taking it back cost the loop's thread ~10 us an ID in the router (docs/benchmarks.md,
# "Third pass"). list.pop is atomic, so no two callers get the same one.
_ID_BATCH: Final = 256
_RANDOM_BYTES: Final = 18
_ids: list[str] = []


def _refill() -> None:
    digits = os.urandom(_RANDOM_BYTES * _ID_BATCH).hex()
    step = 2 * _RANDOM_BYTES
    _ids.extend([digits[at : at + step] for at in range(0, len(digits), step)])


def new_id(prefix: str) -> str:
    try:
        random = _ids.pop()
    except IndexError:
        _refill()
        random = _ids.pop()
    return f"{prefix}_{time.time_ns() // 1_000_000:012x}{random}"  # 12 digits until 10889


if hasattr(os, "register_at_fork"):  # a forked child must not reuse its parent's IDs
    os.register_at_fork(after_in_child=_ids.clear)


def invalid(message: str, param: str | None = None) -> ApiError:
    return ApiError(ErrorCode.REQUEST_INVALID, message, param=param)


def refused(message: str, param: str) -> ApiError:
    """A value the schema allows that cannot be served as it stands."""
    return ApiError(ErrorCode.INVALID_PARAMETER, message, param=param)


def unsupported(message: str, param: str) -> ApiError:
    return ApiError(ErrorCode.UNSUPPORTED_PARAMETER, message, param=param)


@dataclass(slots=True)
class ResponsesRequest:
    """A checked Responses request. `raw` is the client's object (its other fields are
    echoed in the Response); `items` the input as items, each with an ID."""

    raw: dict[str, Any]
    model: str
    items: list[dict[str, Any]]
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: Any = "auto"
    metadata: dict[str, str] = field(default_factory=dict)


def _typed(raw: dict[str, Any], name: str, kinds: tuple[type, ...], what: str) -> Any:
    value = raw.get(name)
    if value is None:
        return None
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise invalid(f"{name}: expected {what}", name)
    return value


def parse(body: bytes) -> ResponsesRequest:
    """The request in `body`; raises ApiError (400) naming the field at fault."""
    try:
        raw = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise invalid(_malformed(body, exc)) from None
    if not isinstance(raw, dict):
        raise invalid("body must be a JSON object")
    model = raw.get("model")
    if not isinstance(model, str) or not model or len(model) > 256:
        raise invalid("model: expected a model name (1 to 256 characters)", "model")
    rare = not _RARE.isdisjoint(raw)
    if rare:
        for name in _UNSUPPORTED:
            if raw.get(name) not in (None, False):
                raise unsupported(f"{name} is not supported by this router", name)
    for name, top in _RANGES:
        number = _typed(raw, name, (int, float), "a number")
        if number is not None and not 0 <= number <= top:
            raise refused(f"{name}: must be between 0 and {top}", name)
    for name in ("stream", "store", "parallel_tool_calls") if rare else ("stream", "store"):
        _typed(raw, name, (bool,), "a boolean")
    limit = _typed(raw, "max_output_tokens", (int, float), "an integer")
    if isinstance(limit, float):
        # JSON Schema's integers include 64.0; a fraction is no integer.
        if not limit.is_integer():
            raise invalid("max_output_tokens: expected an integer", "max_output_tokens")
        limit = int(limit)
    if limit is not None and limit < 1:
        raise refused("max_output_tokens: must be at least 1", "max_output_tokens")
    if limit is not None and limit > MAX_OUTPUT:
        raise refused(f"max_output_tokens: must be at most {MAX_OUTPUT}", "max_output_tokens")
    for name in ("user", "safety_identifier"):
        _typed(raw, name, (str,), "a string")
    previous = _typed(raw, "previous_response_id", (str,), "a response ID")
    instructions = _typed(raw, "instructions", (str,), "a string")
    if rare:
        _check_options(raw)
    request = ResponsesRequest(
        raw=raw,
        model=model,
        items=input_items(raw.get("input"), previous is not None or bool(instructions)),
        stream=raw.get("stream") is True,
        store=raw.get("store") is not False,
        previous_response_id=previous,
        instructions=instructions,
        max_output_tokens=limit,
    )
    if rare:  # absent, they are the defaults: no tools, no metadata, tool_choice "auto"
        request.tools = function_tools(raw.get("tools"))
        request.metadata = _metadata(raw.get("metadata"))
        request.tool_choice = tool_choice(raw.get("tool_choice"), request.tools)
    return request


def _malformed(body: bytes, exc: orjson.JSONDecodeError) -> str:
    """What is wrong with a body that is not JSON, where it is, in the router's words (the
    decoder's own message misplaces an encoding error at the first character)."""
    try:
        body.decode()
    except UnicodeDecodeError as bad:
        return f"malformed JSON: not UTF-8 at byte {bad.start}"
    return f"malformed JSON at line {exc.lineno} column {exc.colno}"


def _check_options(raw: dict[str, Any]) -> None:
    truncation = raw.get("truncation")
    if truncation not in (None, "auto", "disabled"):
        raise invalid("truncation: expected 'auto' or 'disabled'", "truncation")
    include = _typed(raw, "include", (list,), "a list of strings")
    if include is not None and not all(isinstance(x, str) for x in include):
        raise invalid("include: expected a list of strings", "include")
    reasoning = _typed(raw, "reasoning", (dict,), "an object")
    if reasoning is not None:
        _one_of(reasoning, "effort", EFFORTS, "reasoning.")
        _one_of(reasoning, "summary", SUMMARIES, "reasoning.")
    _typed(raw, "prompt_cache_key", (str,), "a string")
    # JSON Schema's integers include 5.0; the schema bounds top_logprobs only.
    for name in ("top_logprobs", "max_tool_calls"):
        number = _typed(raw, name, (int, float), "an integer")
        if isinstance(number, float) and not number.is_integer():
            raise invalid(f"{name}: expected an integer", name)
    top = raw.get("top_logprobs")
    if top is not None and not 0 <= top <= TOP_LOGPROBS:
        raise refused(f"top_logprobs: must be between 0 and {TOP_LOGPROBS}", "top_logprobs")
    text = _typed(raw, "text", (dict,), "an object")
    if text is not None:
        _one_of(text, "verbosity", VERBOSITIES, "text.")
    fmt = text.get("format") if text is not None else None
    if fmt is None:
        return
    if not isinstance(fmt, dict) or fmt.get("type") not in FORMATS:
        raise invalid(
            "text.format.type: expected one of text, json_object, json_schema", "text.format"
        )
    if fmt["type"] == "json_schema":
        if not isinstance(fmt.get("name"), str):
            raise invalid("text.format.name: required for json_schema", "text.format.name")
        if not isinstance(fmt.get("schema"), dict):
            raise invalid("text.format.schema: expected a JSON schema object", "text.format")
        if not isinstance(fmt.get("strict", False), (bool, type(None))):
            raise invalid("text.format.strict: expected a boolean", "text.format.strict")


def _one_of(holder: dict[str, Any], name: str, allowed: frozenset[str], prefix: str) -> None:
    if holder.get(name) not in (None, *allowed):
        where = f"{prefix}{name}"
        raise invalid(f"{where}: expected one of {', '.join(sorted(allowed))}", where)


def _metadata(value: Any) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise invalid("metadata: expected an object of strings", "metadata")
    if len(value) > METADATA_KEYS or any(len(k) > 64 or len(v) > 512 for k, v in value.items()):
        raise refused(
            f"metadata: at most {METADATA_KEYS} pairs, keys up to 64 characters, values up to 512",
            "metadata",
        )
    return value


# -- input -------------------------------------------------------------------------------------

_PARTS: Final = frozenset({"input_text", "output_text", "refusal", "input_image"})


def input_items(value: Any, optional: bool = False) -> list[dict[str, Any]]:
    """The input as a list of items, each checked and given an ID (a string is one user
    message), as GET /v1/responses/{id}/input_items lists them. `optional`: a request that
    continues a response, or has instructions, may leave it out."""
    if value is None:
        if optional:
            return []
        raise refused("input: required (there is nothing else to answer)", "input")
    if isinstance(value, str):
        value = [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise invalid("input: expected a string or a list of items", "input")
    if not value and not optional:
        raise refused("input: at least one item (there is nothing else to answer)", "input")
    items = [_item(item, f"input[{i}]") for i, item in enumerate(value)]
    if len(items) > 1:
        # An ID is how GET .../input_items pages on (`after`): two alike would page forever.
        seen: set[str] = set()
        for i, item in enumerate(items):
            if item["id"] in seen:
                where = f"input[{i}].id"
                raise refused(f"{where}: duplicate item found with ID {item['id']!r}", where)
            seen.add(item["id"])
    return items


def _item(item: Any, where: str) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise invalid(f"{where}: expected an object", where)
    kind = item.get("type", "message")
    if kind == "message":
        return _message(item, where)
    if kind == "function_call":
        for name in ("call_id", "name", "arguments"):
            if not isinstance(item.get(name), str):
                raise invalid(f"{where}.{name}: expected a string", f"{where}.{name}")
        return {**item, "id": _item_id(item, "fc", where), "status": "completed"}
    if kind == "function_call_output":
        if not isinstance(item.get("call_id"), str):
            raise invalid(f"{where}.call_id: expected a string", f"{where}.call_id")
        output = item.get("output")
        if not isinstance(output, (str, list)):
            raise invalid(f"{where}.output: expected a string or parts", f"{where}.output")
        return {**item, "id": _item_id(item, "fco", where), "status": "completed"}
    if kind == "reasoning":
        return {**item, "id": _item_id(item, "rs", where)}
    if kind == "item_reference":
        raise unsupported("item references are not supported: send the item itself", where)
    if not isinstance(kind, str):
        raise invalid(f"{where}.type: expected a string", f"{where}.type")
    raise unsupported(f"input items of type {kind!r} are not supported", f"{where}.type")


def check_outputs(items: list[dict[str, Any]], history: list[dict[str, Any]]) -> None:
    """Every function call output answers a call of the conversation (its history, or an
    earlier item of the input), as OpenAI requires; an engine would be handed a tool
    result for no call."""
    if not any(item.get("type") == "function_call_output" for item in items):
        return
    calls = {item.get("call_id") for item in history if item.get("type") == "function_call"}
    for i, item in enumerate(items):
        kind = item.get("type")
        if kind == "function_call":
            calls.add(item["call_id"])
        elif kind == "function_call_output" and item["call_id"] not in calls:
            where = f"input[{i}].call_id"
            raise refused(
                f"{where}: no function call found with call_id {item['call_id'][:64]!r}",
                where,
            )


def _item_id(item: dict[str, Any], prefix: str, where: str) -> str:
    """The item's own ID, or a new one when it has none (absent, null or empty)."""
    value = item.get("id")
    if value is None or value == "":
        return new_id(prefix)
    if not isinstance(value, str):
        raise invalid(f"{where}.id: expected a string", f"{where}.id")
    return value


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ROLES:
        raise invalid(f"{where}.role: expected one of {', '.join(sorted(ROLES))}", f"{where}.role")
    content = item.get("content")
    if isinstance(content, str):
        kind = "output_text" if role == "assistant" else "input_text"
        parts: list[dict[str, Any]] = [{"type": kind, "text": content}]
    elif isinstance(content, list):
        parts = [_part(part, f"{where}.content[{i}]") for i, part in enumerate(content)]
        if role != "user":
            for i, part in enumerate(parts):
                if part["type"] == "input_image":
                    at = f"{where}.content[{i}]"
                    # Chat engines take images from user messages only: never dropped unsaid.
                    raise refused(f"{at}: images are accepted in user messages only", at)
    else:
        raise invalid(f"{where}.content: expected a string or a list of parts", where)
    return {
        "type": "message",
        "id": _item_id(item, "msg", where),
        "role": role,
        "content": parts,
        "status": "completed",
    }


def _part(part: Any, where: str) -> dict[str, Any]:
    if not isinstance(part, dict):
        raise invalid(f"{where}: expected an object", where)
    kind = part.get("type")
    if kind == "input_file":
        raise unsupported("file inputs are not supported by this router", f"{where}.type")
    if not isinstance(kind, str):
        raise invalid(f"{where}.type: expected a string", f"{where}.type")
    if kind not in _PARTS:
        raise unsupported(f"content parts of type {kind!r} are not supported", f"{where}.type")
    if kind == "input_image":
        if part.get("file_id") is not None:
            raise unsupported("images by file_id are not supported: send image_url", where)
        if not isinstance(part.get("image_url"), str):
            raise refused(f"{where}.image_url: expected a URL or data URL", where)
        return part
    field_name = "refusal" if kind == "refusal" else "text"
    if not isinstance(part.get(field_name), str):
        raise invalid(f"{where}.{field_name}: expected a string", f"{where}.{field_name}")
    return part


# -- tools --------------------------------------------------------------------------------------


# What a client that sends a hosted tool by default can do about it.
CLIENT_RUN = frozenset({"custom"})  # tools the client runs that are not functions
HOSTED_HINTS = {
    "web_search": ' (Codex CLI: set web_search = "disabled" in its config.toml)',
}


def function_tools(value: Any) -> list[dict[str, Any]]:
    """The function tools, those of a `namespace` (a named group of function tools, as
    Codex sends them) included; any other kind is a 400 `unsupported_tool` naming it."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise invalid("tools: expected a list", "tools")
    tools: list[dict[str, Any]] = []
    places: list[str] = []

    def add(tool: Any, where: str, namespace: str | None = None) -> None:
        checked = _function_tool(tool, where)
        tools.append(checked if namespace is None else {**checked, "namespace": namespace})
        places.append(where)

    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if isinstance(tool, dict) and tool.get("type") == "namespace":
            namespace = tool.get("name")
            if not isinstance(namespace, str) or not namespace:
                raise invalid(f"{where}.name: expected the namespace's name", f"{where}.name")
            inner = tool.get("tools")
            if not isinstance(inner, list):
                raise invalid(f"{where}.tools: expected a list of tools", f"{where}.tools")
            for j, one in enumerate(inner):
                add(one, f"{where}.tools[{j}]", namespace)
        else:
            add(tool, where)
    seen: set[str] = set()
    for tool, where in zip(tools, places, strict=True):
        name = engine_name(tools, tool.get("namespace"), tool["name"])
        if name in seen:  # the engine could not tell which one a call means
            raise refused(f"{where}.name: another function tool has this name", f"{where}.name")
        seen.add(name)
    return tools


def engine_name(tools: list[dict[str, Any]], namespace: str | None, name: str) -> str:
    """The name a function has for the engine, which knows no namespaces: its own, unless
    functions of several namespaces (or one outside any) share it, then
    `{namespace}__{name}` (two MCP servers' `search`, as Codex sends them)."""
    if namespace is None or sum(tool["name"] == name for tool in tools) < 2:
        return name
    return f"{namespace}__{name}"


def namespaced(tools: list[dict[str, Any]]) -> dict[str, tuple[str, str]]:
    """The functions that came in a namespace, by the name the engine calls them:
    (namespace, name), what a call item names back to the client (Codex runs an MCP
    server's tool only by its namespace)."""
    return {
        engine_name(tools, tool["namespace"], tool["name"]): (tool["namespace"], tool["name"])
        for tool in tools
        if tool.get("namespace") is not None
    }


def _function_tool(tool: Any, where: str) -> dict[str, Any]:
    if not isinstance(tool, dict) or not isinstance(tool.get("type"), str):
        raise invalid(f"{where}: expected a tool object with a type", where)
    if tool["type"] != "function":
        if tool["type"] in CLIENT_RUN:
            # Run by the client, but a grammar or freeform text chat engines cannot take.
            what = f"tool {tool['type']!r} (a freeform tool the client runs) has no chat form"
        else:
            what = f"tool {tool['type']!r} is a hosted tool this router cannot run"
        hint = HOSTED_HINTS.get(tool["type"], "")
        raise ApiError(
            ErrorCode.UNSUPPORTED_TOOL,
            f"{what}; only function tools (run by the client) are supported{hint}",
            param=f"{where}.type",
        )
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise invalid(f"{where}.name: expected a function name", f"{where}.name")
    parameters = tool.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise invalid(f"{where}.parameters: expected a JSON schema", f"{where}.parameters")
    for member, kind, what in (("strict", bool, "a boolean"), ("description", str, "a string")):
        if tool.get(member) is not None and not isinstance(tool[member], kind):
            raise invalid(f"{where}.{member}: expected {what}", f"{where}.{member}")
    return tool


def tool_choice(value: Any, tools: list[dict[str, Any]]) -> Any:
    if value is None:
        return "auto"
    if value == "required" and not tools:
        raise refused("tool_choice: required needs a function in tools", "tool_choice")
    if value in ("none", "auto", "required"):
        return value
    if not isinstance(value, dict):
        raise invalid("tool_choice: expected none, auto, required or an object", "tool_choice")
    kind = value.get("type")
    names = {tool["name"] for tool in tools}
    if not isinstance(kind, str):
        raise invalid(
            "tool_choice.type: expected a string (function, allowed_tools)", "tool_choice.type"
        )
    if kind == "function":
        name = value.get("name")
        if not isinstance(name, str):
            hint = (
                " (the Responses API names it at the top level, not under 'function' as "
                "chat completions does)"
                if isinstance(value.get("function"), dict)
                else ""
            )
            raise invalid(f"tool_choice.name: expected a function name{hint}", "tool_choice.name")
        if name not in names:
            raise refused("tool_choice.name: names no function in tools", "tool_choice.name")
        namespace = value.get("namespace")
        if namespace is not None and not any(
            tool["name"] == name and tool.get("namespace") == namespace for tool in tools
        ):
            raise refused(
                f"tool_choice.namespace: no namespace {str(namespace)[:64]!r} in tools has a "
                f"function {name!r}",
                "tool_choice.namespace",
            )
        return value
    if kind == "allowed_tools":
        allowed = value.get("tools")
        if value.get("mode") not in ("auto", "required") or not isinstance(allowed, list):
            raise invalid("tool_choice: allowed_tools needs a mode and tools", "tool_choice")
        for i, tool in enumerate(allowed):
            if not isinstance(tool, dict) or tool.get("type") != "function":
                raise ApiError(
                    ErrorCode.UNSUPPORTED_TOOL,
                    "allowed_tools may name function tools only",
                    param="tool_choice.tools",
                )
            if tool.get("name") not in names:
                where = f"tool_choice.tools[{i}].name"
                raise refused(f"{where}: names no function in tools", where)
        if value["mode"] == "required" and not allowed:
            raise refused(
                "tool_choice: allowed_tools in required mode needs at least one tool",
                "tool_choice.tools",
            )
        return value
    raise ApiError(
        ErrorCode.UNSUPPORTED_TOOL,
        f"tool_choice {kind!r} names a hosted tool this router cannot run",
        param="tool_choice.type",
    )
