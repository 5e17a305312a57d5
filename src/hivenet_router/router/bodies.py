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

import re
from typing import Annotated, Any

import msgspec

from hivenet_router.domain.agent import ROUTE_CAPABILITY
from hivenet_router.domain.errors import ApiError, ErrorCode
from hivenet_router.domain.request import RequestFacts
from hivenet_router.routing.prefix import PREFIX_CHARS

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
    # llama.cpp's name for the limit, which it reads before max_tokens: a request's output
    # is held at the larger of the two (pipeline/output_bound.py lowers both). Any type,
    # as before it was read: the engine judges a value the router does not count.
    n_predict: Any = None
    # Tool schemas become part of the prompt: their size feeds the estimate. An empty Raw
    # stands for "absent" (msgspec cannot put Raw in a union with None). `functions` is
    # OpenAI's older name for tools, `documents` vLLM's retrieval documents for the chat
    # template: both reach the model too.
    tools: msgspec.Raw = msgspec.Raw()
    functions: msgspec.Raw = msgspec.Raw()
    documents: msgspec.Raw = msgspec.Raw()


class _Chat(_Common):
    messages: Annotated[list[Any], msgspec.Meta(min_length=1)]
    # Choices generated: the output bound holds max_tokens for each of them.
    n: int | float | None = None


class _Completion(_Common):
    prompt: str | list[Any] | None
    n: int | float | None = None


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
ROUTES = tuple(_DECODERS)  # the routes whose bodies `parse` reads


_IMAGE_PARTS = frozenset({"image_url", "image", "input_image"})
_TEXT_FIELDS = ("text", "thinking", "arguments")
_BYTES_PER_TOKEN_ID = 4  # a prompt given as token IDs: about what a token's text takes
MAX_OUTPUT = 2**31 - 1  # larger output limits are refused, not reserved
MAX_CHOICES = 128  # `n`, as OpenAI's API bounds it


class _Tally:
    """What a prompt holds: its text bytes, its images and its leading text pieces in order.

    Pieces are kept only until they (and a separator after each) cover PREFIX_CHARS, all
    that prefix routing reads: a prompt of a million short strings or token IDs costs its
    first pieces, not a million references or a million new strings.
    """

    __slots__ = ("images", "pieces", "room", "text_bytes")

    def __init__(self) -> None:
        self.text_bytes = 0
        self.images = 0
        self.pieces: list[str] = []
        self.room = PREFIX_CHARS + 1  # the last separator is the one prefix reading skips

    def text(self, value: str) -> None:
        # An ASCII string's length is its UTF-8 size (isascii reads a flag, no scan).
        self.text_bytes += len(value) if value.isascii() else len(value.encode())
        if self.room > 0:
            self.pieces.append(value)
            self.room -= len(value) + 1

    def piece(self, value: str) -> None:
        """A piece of the prompt that is not counted as text (a role name)."""
        if self.room > 0:
            self.pieces.append(value)
            self.room -= len(value) + 1


def _content(content: Any, tally: _Tally, depth: int = 0) -> None:
    """Tally a message content's text and images.

    Reads OpenAI content parts and Anthropic blocks alike, including what an agentic client
    sends most of: tool results (nested blocks) and tool calls (JSON arguments).
    """
    if isinstance(content, str):
        tally.text(content)
    elif isinstance(content, list):
        if depth >= _NEST_LIMIT:
            tally.text_bytes += len(msgspec.json.encode(content))
            return
        for part in content:
            if isinstance(part, dict):
                _part(part, tally, depth)
            elif isinstance(part, str):
                tally.text(part)


def _part(part: dict[str, Any], tally: _Tally, depth: int) -> None:
    """A part with no image and no text field of its own still reaches the model
    (documents, files, audio, video, blocks added later): it counts by the size of its
    JSON, as tools do, and so does content nested past _NEST_LIMIT."""
    kind = part.get("type")
    if not isinstance(kind, str):
        kind = None  # the engine judges a part of no type, or of a type that is no string
    if kind in _IMAGE_PARTS:
        tally.images += 1
        return
    counted = False
    for name in _TEXT_FIELDS:
        text = part.get(name)
        if isinstance(text, str):
            tally.text(text)
            counted = True
    if kind in ("tool_result", "search_result"):
        _content(part.get("content"), tally, depth + 1)
    elif kind == "tool_use":
        tally.text(msgspec.json.encode(part.get("input")).decode())
    elif not counted and kind not in (None, "text"):
        tally.text_bytes += len(msgspec.json.encode(part))


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
            if isinstance(message, dict) and message:
                _message(message, tally)
    prompt = getattr(decoded, "prompt", None)
    if isinstance(prompt, str):
        tally.text(prompt)
    elif isinstance(prompt, list):
        _prompts(prompt, tally)
    # An embedding's input, a rerank's query and documents: their size feeds the input
    # estimate (the daily budget holds it), and no piece (no prefix cache to route to).
    for field in ("input", "query", "documents"):
        value = getattr(decoded, field, None)
        if isinstance(value, str | list):
            sized = _Tally()
            sized.room = 0
            if isinstance(value, str):
                sized.text(value)
            else:
                _prompts(value, sized)
            tally.text_bytes += sized.text_bytes
        elif isinstance(value, msgspec.Raw):  # vLLM's chat documents, kept raw
            tally.text_bytes += len(value)
    for field in ("tools", "functions"):
        raw = getattr(decoded, field, None)
        if raw is not None:
            tally.text_bytes += len(raw)
    return tally, count


def _message(message: dict[str, Any], tally: _Tally) -> None:
    role = message.get("role")
    if isinstance(role, str):
        tally.piece(role)
    name = message.get("name")
    if isinstance(name, str):
        tally.text(name)
    content = message.get("content")
    if content is not None:
        _content(content, tally)
    calls = message.get("tool_calls")
    if isinstance(calls, list):
        for call in calls:
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict):
                _part(function, tally, 0)


def _prompts(prompt: list[Any], tally: _Tally, nested: bool = False) -> None:
    """A completion prompt given as a list: texts, token IDs, both mixed (llama.cpp reads
    them), or a batch of any of those."""
    for item in prompt:
        if isinstance(item, int):
            tally.text_bytes += _BYTES_PER_TOKEN_ID
            if tally.room > 0:  # no string made for an ID that prefix routing never reads
                tally.piece(str(item))
        elif isinstance(item, str):
            tally.text(item)
        elif isinstance(item, list) and not nested:
            _prompts(item, tally, nested=True)
        else:
            tally.text_bytes += len(msgspec.json.encode(item))


def _batch(prompt: object) -> int:
    """How many prompts a completions `prompt` holds: a list of texts, or of token-ID lists,
    is a batch, each answered on its own; a text, a list of token IDs, or a list that mixes
    IDs with texts (llama.cpp reads that as one prompt) is one."""
    if not isinstance(prompt, list) or not prompt:
        return 1
    if any(isinstance(item, int) for item in prompt):
        return 1
    return len(prompt)


def _counted(value: object) -> int | None:
    """An engine's own limit field as the router counts it (`_declared`, capped where every
    limit is rather than refused: the router did not read it before); else undeclared."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return _declared(min(value, MAX_OUTPUT), "n_predict")


def _declared(value: float | None, field: str) -> int | None:
    if value is None or value < 0 or (isinstance(value, float) and not value.is_integer()):
        return None
    if value > MAX_OUTPUT:
        raise ApiError(
            ErrorCode.REQUEST_INVALID, f"{field} must be at most {MAX_OUTPUT}", param=field
        )
    return int(value)


def parse(route: str, body: bytes) -> RequestFacts:
    if not body:
        raise ApiError(ErrorCode.REQUEST_INVALID, "request body is empty")
    try:
        decoded = _DECODERS[route].decode(body)
    except msgspec.ValidationError as exc:
        message = str(exc)
        raise ApiError(
            ErrorCode.REQUEST_INVALID, _explain(message, body), param=_param(message)
        ) from None
    except msgspec.DecodeError as exc:
        raise ApiError(ErrorCode.REQUEST_INVALID, f"malformed JSON: {exc}") from None
    except RecursionError:
        # msgspec follows nesting on the C stack; past Python's limit it gives up here.
        raise ApiError(ErrorCode.REQUEST_INVALID, "JSON is nested too deeply") from None
    if not body.isascii():
        # The decoder checks only the strings it reads: bytes that are not UTF-8 in any
        # other field went to the engine as they came.
        try:
            body.decode()
        except UnicodeDecodeError as bad:
            raise ApiError(
                ErrorCode.REQUEST_INVALID, f"malformed JSON: not UTF-8 at byte {bad.start}"
            ) from None
    stream = bool(getattr(decoded, "stream", None))
    # As the engines read them: max_completion_tokens, unless it is absent or 0, in which
    # case max_tokens (absent: undeclared).
    given = getattr(decoded, "max_completion_tokens", None)
    newer = _declared(given, "max_completion_tokens")
    plain = getattr(decoded, "max_tokens", None)
    older = _declared(plain, "max_tokens")
    max_out = newer if newer else older
    raw_alias = getattr(decoded, "n_predict", None)
    alias = _counted(raw_alias)
    if alias is not None:
        max_out = alias if max_out is None else max(max_out, alias)
    # A field present that was not counted: an engine may read it as no limit at all.
    loose = (
        (given is not None and newer is None)
        or (plain is not None and older is None)
        or (raw_alias is not None and alias is None)
    )
    # Every prompt of a batch gets its `n` answers, each up to the limit.
    n = _declared(getattr(decoded, "n", None), "n") or 1
    if n > MAX_CHOICES:
        # OpenAI's own bound: one request of 100,000,000 choices grew an engine past its
        # memory and took its model offline for every client.
        raise ApiError(ErrorCode.REQUEST_INVALID, f"n must be at most {MAX_CHOICES}", param="n")
    choices = n * _batch(getattr(decoded, "prompt", None))
    if max_out is not None:
        max_out *= choices  # the whole request's output, as every limit counts it
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
        choices,
        loose,
    )


_AT = re.compile(r"- at `\$\.([^`]+)`")
_MISSING = re.compile(r"missing required field `([^`]+)`")


def _param(message: str) -> str | None:
    """The field a validation message names (`messages[0].content`), as OpenAI's `param`
    names it, so SDKs can point at it; None when the body as a whole is at fault."""
    at = _AT.search(message)
    missing = _MISSING.search(message)
    if missing is not None:
        inside = at.group(1) + "." if at is not None else ""
        return inside + missing.group(1)
    return at.group(1) if at is not None else None


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


class _Named(msgspec.Struct):
    model: str = ""


_NAMED = msgspec.json.Decoder(_Named)
MODEL_NAME_CHARS = 256  # longer names are no model the router serves


def model_of(body: bytes) -> str:
    """The `model` a body refused as invalid names, when it names one as a string (so the
    refusal is recorded under it); "" otherwise. Only that member is decoded."""
    try:
        model = _NAMED.decode(body).model
    except (msgspec.DecodeError, RecursionError):
        return ""
    return model if len(model) <= MODEL_NAME_CHARS else ""
