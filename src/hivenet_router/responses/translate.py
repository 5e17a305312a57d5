"""A Responses request as a chat completions request, and a chat answer as a Response.

Items become chat messages in order: `instructions` first as a system message, a
`developer` message as a system one (system messages in a row joined into one),
consecutive `function_call` items one assistant message with `tool_calls` (joined to the
assistant text just before them), a `function_call_output` a `tool` message. Reasoning
items are dropped: chat engines take no reasoning back. Function tools, `tool_choice`,
`text.format`, `max_output_tokens`, sampling, `reasoning.effort` (as `reasoning_effort`,
which engines without it ignore) map to their chat names; `include`, `truncation`,
`metadata` and `store` stay with the router.
"""

from __future__ import annotations

import time
from typing import Any, Final

import orjson

from hivenet_router.responses.request import ResponsesRequest, engine_name, namespaced, new_id

# Chat finish reasons that end a Response short of its end, and the reason it then gives.
INCOMPLETE: Final = {"length": "max_output_tokens", "content_filter": "content_filter"}


def _text(parts: list[dict[str, Any]]) -> str:
    return "\n".join(p.get("text") or p.get("refusal") or "" for p in parts)


def _content(role: str, parts: list[dict[str, Any]]) -> Any:
    """Text-only content as one string (every chat template takes that); with images, the
    chat parts."""
    if role != "user" or all(p["type"] != "input_image" for p in parts):
        return _text(parts)
    out: list[dict[str, Any]] = []
    for part in parts:
        if part["type"] == "input_image":
            image = {"url": part["image_url"]}
            if part.get("detail") in ("low", "high", "auto"):
                image["detail"] = part["detail"]
            out.append({"type": "image_url", "image_url": image})
        else:
            out.append({"type": "text", "text": part.get("text") or part.get("refusal") or ""})
    return out


def _output(value: Any) -> str:
    if isinstance(value, str):
        return value
    return "\n".join(p.get("text", "") for p in value if isinstance(p, dict))


def messages(
    instructions: str | None,
    items: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """The chat messages for a conversation's items; a call of a namespace's function is
    named as the engine knows it among `tools` (request.engine_name)."""
    out: list[dict[str, Any]] = []
    if instructions:
        out.append({"role": "system", "content": instructions})
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            role = "system" if item["role"] == "developer" else item["role"]
            content = _content(role, item["content"])
            if role == "system" and out and out[-1]["role"] == "system":
                # One system message: many chat templates refuse a second in a row.
                out[-1]["content"] += "\n\n" + content
            else:
                out.append({"role": role, "content": content})
        elif kind == "function_call":
            name = item["name"]
            if tools and item.get("namespace") is not None:
                name = engine_name(tools, item["namespace"], name)
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": name, "arguments": item["arguments"]},
            }
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": item["call_id"],
                    "content": _output(item["output"]),
                }
            )
    return out


def _chat_tools(request: ResponsesRequest) -> tuple[list[dict[str, Any]], Any]:
    tools = request.tools
    choice = request.tool_choice
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        allowed = {tool.get("name") for tool in choice["tools"]}
        tools = [tool for tool in tools if tool["name"] in allowed]
        choice = choice["mode"]
    elif isinstance(choice, dict):
        wanted = choice.get("namespace")
        namespace = next(
            (
                t.get("namespace")
                for t in tools
                if t["name"] == choice["name"] and wanted in (None, t.get("namespace"))
            ),
            None,
        )
        called = engine_name(request.tools, namespace, choice["name"])
        choice = {"type": "function", "function": {"name": called}}
    chat = []
    for tool in tools:
        function = {"name": engine_name(request.tools, tool.get("namespace"), tool["name"])}
        for name in ("description", "parameters", "strict"):
            if tool.get(name) is not None:
                function[name] = tool[name]
        chat.append({"type": "function", "function": function})
    return chat, choice


def _response_format(fmt: Any) -> dict[str, Any] | None:
    if not isinstance(fmt, dict) or fmt.get("type") == "text":
        return None
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    schema = {"name": fmt["name"], "schema": fmt["schema"]}
    for name in ("strict", "description"):
        if fmt.get(name) is not None:
            schema[name] = fmt[name]
    return {"type": "json_schema", "json_schema": schema}


def chat_body(request: ResponsesRequest, history: list[dict[str, Any]]) -> bytes:
    """The chat completions body for `request`, continuing `history` (the items of the
    responses before it, their outputs included)."""
    raw = request.raw
    chat: dict[str, Any] = {
        "model": request.model,
        "messages": messages(request.instructions, [*history, *request.items], request.tools),
        "stream": request.stream,
    }
    if request.max_output_tokens is not None:
        chat["max_tokens"] = request.max_output_tokens
    for name in ("temperature", "top_p"):
        if raw.get(name) is not None:
            chat[name] = raw[name]
    tools, choice = _chat_tools(request) if request.tools else ([], None)
    if tools and choice != "none":
        chat["tools"] = tools
        chat["tool_choice"] = choice
        if raw.get("parallel_tool_calls") is not None:
            chat["parallel_tool_calls"] = raw["parallel_tool_calls"]
    text = raw.get("text")
    fmt = _response_format(text.get("format") if isinstance(text, dict) else None)
    if fmt is not None:
        chat["response_format"] = fmt
    reasoning = raw.get("reasoning")
    if isinstance(reasoning, dict) and reasoning.get("effort") is not None:
        chat["reasoning_effort"] = reasoning["effort"]
    user = raw.get("safety_identifier") or raw.get("user")
    if isinstance(user, str):
        chat["user"] = user
    return orjson.dumps(chat)


# -- the answer --------------------------------------------------------------------------------


def skeleton(request: ResponsesRequest, response_id: str) -> dict[str, Any]:
    """A Response in progress, with what the request set echoed back."""
    raw = request.raw
    text: dict[str, Any] = raw["text"] if isinstance(raw.get("text"), dict) else {}
    reasoning: dict[str, Any] = raw["reasoning"] if isinstance(raw.get("reasoning"), dict) else {}
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": "in_progress",
        "background": False,
        "error": None,
        "incomplete_details": None,
        "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens,
        "model": request.model,
        "output": [],
        "parallel_tool_calls": raw.get("parallel_tool_calls") is not False,
        "previous_response_id": request.previous_response_id,
        "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
        "store": request.store,
        "temperature": raw.get("temperature", 1.0),
        "text": {
            "format": text.get("format") or {"type": "text"},
            **({"verbosity": text["verbosity"]} if text.get("verbosity") else {}),
        },
        "tool_choice": request.tool_choice,
        "tools": [
            {
                "type": "function",
                "name": tool["name"],
                "description": tool.get("description"),
                "parameters": tool.get("parameters"),
                "strict": tool.get("strict"),
                **({"namespace": tool["namespace"]} if "namespace" in tool else {}),
            }
            for tool in request.tools
        ],
        "top_p": raw.get("top_p", 1.0),
        "truncation": raw.get("truncation") or "disabled",
        "metadata": request.metadata,
        # `usage` is set once known; `user` only when the client sent one (neither is
        # nullable in OpenAI's schema).
        **({"user": raw["user"]} if isinstance(raw.get("user"), str) else {}),
        **{name: raw[name] for name in _ECHOED if raw.get(name) is not None},
    }


# Set by the client, echoed when set (checked by responses/request.py).
_ECHOED: Final = ("safety_identifier", "prompt_cache_key", "top_logprobs", "max_tool_calls")


def _count(details: Any, name: str) -> int:
    value = details.get(name) if isinstance(details, dict) else None
    return value if isinstance(value, int) else 0


def usage(chat: Any) -> dict[str, Any] | None:
    """A chat `usage` object in the Responses shape (None for none)."""
    if not isinstance(chat, dict):
        return None
    prompt = chat.get("prompt_tokens")
    completion = chat.get("completion_tokens")
    if not isinstance(prompt, int) or not isinstance(completion, int):
        return None
    cached = _count(chat.get("prompt_tokens_details"), "cached_tokens")
    reasoning = _count(chat.get("completion_tokens_details"), "reasoning_tokens")
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": prompt + completion,
    }


def _text_or(value: Any, default: str) -> str:
    return value if isinstance(value, str) and value else default


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def finish(response: dict[str, Any], reason: str | None, used: dict[str, Any] | None) -> None:
    """Set how a Response ended from the chat finish reason."""
    incomplete = INCOMPLETE.get(reason or "")
    response["status"] = "incomplete" if incomplete else "completed"
    response["incomplete_details"] = {"reason": incomplete} if incomplete else None
    if used is not None:
        response["usage"] = used
    if not incomplete:
        response["completed_at"] = int(time.time())


def response_from_chat(base: dict[str, Any], chat: dict[str, Any]) -> dict[str, Any]:
    """The whole Response for a whole chat answer (its first choice)."""
    response = dict(base)
    output: list[dict[str, Any]] = []
    choices = chat.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices else {}
    choice = choice if isinstance(choice, dict) else {}
    message = choice.get("message")
    message = message if isinstance(message, dict) else {}
    reason = choice.get("finish_reason")
    reason = reason if isinstance(reason, str) else None
    calls = message.get("tool_calls")
    calls = calls if isinstance(calls, list) else []
    status = "incomplete" if reason in INCOMPLETE else "completed"
    thought = message.get("reasoning_content") or message.get("reasoning")
    if isinstance(thought, str) and thought:
        output.append(
            {
                "type": "reasoning",
                "id": new_id("rs"),
                "summary": [],
                "content": [{"type": "reasoning_text", "text": thought}],
                "status": status,
            }
        )
    content = message.get("content")
    if isinstance(content, str) and (content or not calls):
        output.append(
            {
                "type": "message",
                "id": new_id("msg"),
                "role": "assistant",
                "status": status,
                "content": [text_part(content)],
            }
        )
    grouped = namespaced(base["tools"]) if calls and base["tools"] else {}
    for at, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            continue
        item = {
            "type": "function_call",
            "id": new_id("fc"),
            "call_id": _text_or(call.get("id"), new_id("call")),
            "name": _text_or(function.get("name"), ""),
            "arguments": _text_or(function.get("arguments"), ""),
            # An answer cut short (its token limit) cut its last call's arguments.
            "status": status if at == len(calls) - 1 else "completed",
        }
        output.append(name_call(item, grouped))
    response["output"] = output
    finish(response, reason, usage(chat.get("usage")))
    return response


def name_call(item: dict[str, Any], grouped: dict[str, tuple[str, str]]) -> dict[str, Any]:
    """A function call item as the client named the function: with its namespace, and
    the name it has there, for one of a namespace's functions (request.namespaced)."""
    found = grouped.get(item["name"])
    if found is not None:
        item["namespace"], item["name"] = found
    return item
