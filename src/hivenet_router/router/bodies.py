"""Read only what routing needs from a request body; keep the original bytes to forward.

msgspec decodes the few fields named here and skips the rest without building objects for
them, while still rejecting malformed JSON. A wrong type is a 400 `request_invalid` whose
message names the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

import msgspec

from hivenet_router.domain.agent import ROUTE_CAPABILITY
from hivenet_router.domain.errors import ApiError, ErrorCode

ModelId = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
TokenCount = Annotated[int, msgspec.Meta(ge=0)]


class _StreamOptions(msgspec.Struct):
    include_usage: bool | None = None


class _Common(msgspec.Struct, kw_only=True):
    model: ModelId
    stream: bool | None = None
    stream_options: _StreamOptions | None = None
    max_tokens: TokenCount | None = None
    max_completion_tokens: TokenCount | None = None


class _Chat(_Common):
    messages: Annotated[list[Any], msgspec.Meta(min_length=1)]
    tools: msgspec.Raw | None = None


class _Completion(_Common):
    prompt: str | list[Any]


class _Messages(_Common):
    messages: Annotated[list[Any], msgspec.Meta(min_length=1)]
    system: Any = None
    tools: msgspec.Raw | None = None


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


@dataclass(frozen=True, slots=True)
class RequestFacts:
    route: str
    model: str
    capability: str
    stream: bool
    max_output_tokens: int | None
    text_bytes: int = 0  # prompt text, system prompt and raw tool JSON, for the estimate
    messages: int = 0
    images: int = 0


_IMAGE_PARTS = frozenset({"image_url", "image", "input_image"})


def _content(content: Any, tally: list[int]) -> None:
    """Add a message content's text bytes to tally[0] and its images to tally[1]."""
    if isinstance(content, str):
        tally[0] += len(content.encode())
    elif isinstance(content, list):
        for part in content:
            if isinstance(part, dict):
                kind = part.get("type")
                if kind in _IMAGE_PARTS:
                    tally[1] += 1
                text = part.get("text")
                if isinstance(text, str):
                    tally[0] += len(text.encode())
            elif isinstance(part, str):
                tally[0] += len(part.encode())


def _measure(decoded: Any) -> tuple[int, int, int]:
    tally = [0, 0]
    messages = getattr(decoded, "messages", None)
    count = 0
    if isinstance(messages, list):
        count = len(messages)
        for message in messages:
            if isinstance(message, dict):
                _content(message.get("content"), tally)
    _content(getattr(decoded, "system", None), tally)
    prompt = getattr(decoded, "prompt", None)
    if prompt is not None:
        _content(prompt if isinstance(prompt, str) else [str(p) for p in prompt], tally)
    tools = getattr(decoded, "tools", None)
    if tools is not None:
        tally[0] += len(tools)
    return tally[0], count, tally[1]


def parse(route: str, body: bytes) -> RequestFacts:
    if not body:
        raise ApiError(ErrorCode.REQUEST_INVALID, "request body is empty")
    try:
        decoded = _DECODERS[route].decode(body)
    except msgspec.ValidationError as exc:
        raise ApiError(ErrorCode.REQUEST_INVALID, _explain(str(exc), body)) from None
    except msgspec.DecodeError as exc:
        raise ApiError(ErrorCode.REQUEST_INVALID, f"malformed JSON: {exc}") from None
    stream = bool(getattr(decoded, "stream", None))
    max_out = getattr(decoded, "max_completion_tokens", None)
    if max_out is None:
        max_out = getattr(decoded, "max_tokens", None)
    text_bytes, messages, images = _measure(decoded)
    return RequestFacts(
        route, decoded.model, ROUTE_CAPABILITY[route], stream, max_out, text_bytes, messages, images
    )


def _explain(message: str, body: bytes) -> str:
    # msgspec says "Object missing required field `model`"; the spec's wording is friendlier
    # for the commonest mistake, and a non-object body deserves its own sentence.
    if "missing required field `model`" in message:
        return "model field is required"
    try:
        value = _ANY.decode(body)
    except msgspec.DecodeError:
        return message
    if not isinstance(value, dict):
        return "request body must be a JSON object"
    return message
