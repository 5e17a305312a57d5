"""Read only what routing needs from a request body; keep the original bytes to forward.

msgspec decodes the few fields named here and skips the rest without building objects for
them, while still rejecting malformed JSON. The router checks only the types of the fields
it interprets itself (model, stream, the output limit, the prompt it estimates), and only
as strictly as the official OpenAI and Anthropic schemas do: everything else (tools,
tool_choice, response_format, thinking, cache_control, fields added next year) belongs to
the engine, which receives the body unchanged. A wrong type is a 400 `request_invalid`
whose message names the field.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from hivenet_router.domain.agent import ROUTE_CAPABILITY
from hivenet_router.domain.errors import ApiError, ErrorCode
from hivenet_router.domain.request import RequestFacts

ModelId = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
# Parts of a message whose text the model reads, and how deep tool results nest.
_NEST_LIMIT = 3


class _Common(msgspec.Struct, kw_only=True):
    model: ModelId
    stream: bool | None = None
    # Any integer: OpenAI's schema sets no minimum on chat, and a negative value counts as
    # undeclared output, as the Go router treats it; the engine judges the value itself.
    # JSON Schema's integers include 64.0, so floats are read too (a fraction counts as
    # undeclared, and the engine answers it).
    max_tokens: int | float | None = None
    max_completion_tokens: int | float | None = None
    # Tool schemas become part of the prompt: their size feeds the estimate. An empty Raw
    # stands for "absent" (msgspec cannot put Raw in a union with None).
    tools: msgspec.Raw = msgspec.Raw()


class _Chat(_Common):
    messages: Annotated[list[Any], msgspec.Meta(min_length=1)]


class _Completion(_Common):
    prompt: str | list[Any] | None


class _Messages(_Common):
    # Anthropic's schema sets no minimum length on messages.
    messages: list[Any]
    system: Any = None


class _Embeddings(msgspec.Struct):
    model: ModelId
    input: str | list[Any]


class _Rerank(msgspec.Struct):
    model: ModelId
    query: str
    documents: list[Any]


_DECODERS: dict[str, msgspec.json.Decoder[Any]] = {
    "/v1/chat/completions": msgspec.json.Decoder(_Chat),
    "/v1/completions": msgspec.json.Decoder(_Completion),
    "/v1/messages": msgspec.json.Decoder(_Messages),
    "/v1/messages/count_tokens": msgspec.json.Decoder(_Messages),
    "/v1/embeddings": msgspec.json.Decoder(_Embeddings),
    "/v1/rerank": msgspec.json.Decoder(_Rerank),
}
_ANY = msgspec.json.Decoder()


_IMAGE_PARTS = frozenset({"image_url", "image", "input_image"})
_TEXT_FIELDS = ("text", "thinking", "arguments")


class _Tally:
    """What a prompt holds: its text bytes, its images and its text pieces in order."""

    __slots__ = ("images", "pieces", "text_bytes")

    def __init__(self) -> None:
        self.text_bytes = 0
        self.images = 0
        self.pieces: list[str] = []

    def text(self, value: str) -> None:
        self.text_bytes += len(value.encode())
        self.pieces.append(value)


def _content(content: Any, tally: _Tally, depth: int = 0) -> None:
    """Tally a message content's text and images.

    Reads OpenAI content parts and Anthropic blocks alike, including what an agentic client
    sends most of: tool results (nested blocks) and tool calls (JSON arguments).
    """
    if isinstance(content, str):
        tally.text(content)
    elif isinstance(content, list) and depth < _NEST_LIMIT:
        for part in content:
            if isinstance(part, dict):
                _part(part, tally, depth)
            elif isinstance(part, str):
                tally.text(part)


def _part(part: dict[str, Any], tally: _Tally, depth: int) -> None:
    kind = part.get("type")
    if kind in _IMAGE_PARTS:
        tally.images += 1
        return
    for name in _TEXT_FIELDS:
        text = part.get(name)
        if isinstance(text, str):
            tally.text(text)
    if kind == "tool_result":
        _content(part.get("content"), tally, depth + 1)
    elif kind == "tool_use":
        tally.text(msgspec.json.encode(part.get("input")).decode())


def _measure(decoded: Any) -> tuple[_Tally, int]:
    tally = _Tally()
    # The system prompt first: pieces follow the order the model reads, so that prompts
    # sharing a system prompt share a prefix.
    _content(getattr(decoded, "system", None), tally)
    messages = getattr(decoded, "messages", None)
    count = 0
    if isinstance(messages, list):
        count = len(messages)
        for message in messages:
            if isinstance(message, dict):
                role = message.get("role")
                if isinstance(role, str):
                    tally.pieces.append(role)
                _content(message.get("content"), tally)
                calls = message.get("tool_calls")
                if isinstance(calls, list):
                    for call in calls:
                        function = call.get("function") if isinstance(call, dict) else None
                        if isinstance(function, dict):
                            _part(function, tally, 0)
    prompt = getattr(decoded, "prompt", None)
    if prompt is not None:
        _content(prompt if isinstance(prompt, str) else [str(p) for p in prompt], tally)
    tools = getattr(decoded, "tools", None)
    if tools is not None:
        tally.text_bytes += len(tools)
    return tally, count


def _declared(value: float | None) -> int | None:
    if value is None or value < 0 or (isinstance(value, float) and not value.is_integer()):
        return None
    return int(value)


def parse(route: str, body: bytes) -> RequestFacts:
    if not body:
        raise ApiError(ErrorCode.REQUEST_INVALID, "request body is empty")
    try:
        decoded = _DECODERS[route].decode(body)
    except msgspec.ValidationError as exc:
        raise ApiError(ErrorCode.REQUEST_INVALID, _explain(str(exc), body)) from None
    except msgspec.DecodeError as exc:
        raise ApiError(ErrorCode.REQUEST_INVALID, f"malformed JSON: {exc}") from None
    except RecursionError:
        # msgspec follows nesting on the C stack; past Python's limit it gives up here.
        raise ApiError(ErrorCode.REQUEST_INVALID, "JSON is nested too deeply") from None
    stream = bool(getattr(decoded, "stream", None))
    max_out = _declared(getattr(decoded, "max_completion_tokens", None))
    if max_out is None:
        max_out = _declared(getattr(decoded, "max_tokens", None))
    tally, messages = _measure(decoded)
    return RequestFacts(
        route,
        decoded.model,
        ROUTE_CAPABILITY[route],
        stream,
        max_out,
        tally.text_bytes,
        messages,
        tally.images,
        tuple(tally.pieces),
    )


def _explain(message: str, body: bytes) -> str:
    # msgspec says "Object missing required field `model`"; the spec's wording is friendlier
    # for the commonest mistake, and a non-object body deserves its own sentence.
    if "missing required field `model`" in message:
        return "model field is required"
    try:
        value = _ANY.decode(body)
    except (msgspec.DecodeError, RecursionError):
        return message
    if not isinstance(value, dict):
        return "request body must be a JSON object"
    return message
