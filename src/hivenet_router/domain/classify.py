"""Turn a backend's error answer into the router's error envelope.

The Go agent classifies only native chat completions and passes the other routes through,
so an Anthropic-format 400 used to reach clients as a 502 `backend_error`. Here every route
is classified the same way, and the backend's 4xx status survives.
"""

from __future__ import annotations

from typing import Any

import orjson

from hivenet_router.domain.errors import STATUS, ErrorCode, code_from_str, error_body

_TYPE_MAP = {
    "context_length_exceeded": ErrorCode.CONTEXT_LENGTH_EXCEEDED,
    "exceed_context_size_error": ErrorCode.CONTEXT_LENGTH_EXCEEDED,  # llama.cpp's server
    "invalid_request_error": ErrorCode.INVALID_PARAMETER,
    "invalid_parameter": ErrorCode.INVALID_PARAMETER,
}
_CONTEXT_WORDS = ("length", "window", "token", "size")
# Anthropic's own words for an over-long prompt ("prompt is too long: N tokens > M maximum").
_TOO_LONG = "prompt is too long"
# What llama.cpp answers with HTTP 500 that is the request's own doing, which no retry
# mends and no agent should be blamed for: an image sent to a model without vision, an
# input longer than an embedding model's batch (any text over 512 tokens, by default).
_REQUEST_FAULTS = (
    ("image input is not supported", ErrorCode.UNSUPPORTED_PARAMETER),
    ("image input is not allowed", ErrorCode.UNSUPPORTED_PARAMETER),
    ("too large to process", ErrorCode.CONTEXT_LENGTH_EXCEEDED),
)
MESSAGE_LIMIT = 512


def _message_and_type(raw: bytes) -> tuple[str, str]:
    try:
        body: Any = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return raw[:MESSAGE_LIMIT].decode(errors="replace"), ""
    if isinstance(body, dict):
        inner = body.get("error")
        source = inner if isinstance(inner, dict) else body
        message = source.get("message") if isinstance(source, dict) else None
        kind = source.get("type") if isinstance(source, dict) else None
        if isinstance(inner, str):
            message = inner
        return (
            str(message if message is not None else raw[:MESSAGE_LIMIT].decode(errors="replace")),
            str(kind or ""),
        )
    return raw[:MESSAGE_LIMIT].decode(errors="replace"), ""


def message_of(raw: bytes) -> str:
    return _message_and_type(raw)[0]


def structured_code(raw: bytes) -> ErrorCode | None:
    """The code of a body that already is the router's own envelope, else None."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    if isinstance(body, dict):
        inner = body.get("error")
        if isinstance(inner, dict) and isinstance(inner.get("code"), str) and "source" in inner:
            return code_from_str(inner["code"])
    return None


def classify(status: int, raw: bytes) -> tuple[ErrorCode, int, bytes]:
    """Map a non-success backend answer to (code, client status, envelope body)."""
    message, kind = _message_and_type(raw)
    message = message[:MESSAGE_LIMIT]
    code = _TYPE_MAP.get(kind)
    if code is ErrorCode.INVALID_PARAMETER and status not in (400, 413, 422):
        # OpenAI's servers say invalid_request_error for an unknown model (404) and a wrong
        # key (401) too: the type names a family, the status says which. Read as the
        # client's mistake, those would be refused rather than tried on another agent.
        code = None
    lowered = message.lower()
    context_words = (
        "context" in lowered and any(word in lowered for word in _CONTEXT_WORDS)
    ) or _TOO_LONG in lowered
    if code is None and status == 413 and not context_words:
        code = ErrorCode.REQUEST_TOO_LARGE  # the engine's own size bound, not a retry's
    elif code is None and status >= 500:
        code = next((fault for words, fault in _REQUEST_FAULTS if words in lowered), None)
    if code in (None, ErrorCode.INVALID_PARAMETER) and status in (400, 413, 422):
        # Anthropic and OpenAI both say invalid_request_error for an over-long prompt; the
        # message tells the two apart.
        code = ErrorCode.CONTEXT_LENGTH_EXCEEDED if context_words else ErrorCode.INVALID_PARAMETER
    elif code is None:
        if status in (429, 503, 529):  # 529: Anthropic's "overloaded"
            code = ErrorCode.BACKEND_UNAVAILABLE
        elif status == 404:
            # The model the agent registered is not the engine's, or the engine has no such
            # route (a token count on an engine without one): only the first is the agent's
            # to answer for, and the second would fail alike on a retry.
            code = ErrorCode.MODEL_NOT_FOUND if "model" in lowered else ErrorCode.NOT_FOUND
        else:
            code = ErrorCode.BACKEND_ERROR
    client_status = (
        400 if code in (ErrorCode.CONTEXT_LENGTH_EXCEEDED, ErrorCode.INVALID_PARAMETER) else 0
    )
    if code in (ErrorCode.MODEL_NOT_FOUND, ErrorCode.NOT_FOUND):
        client_status = 404
    final_status = client_status or STATUS[code]
    return code, final_status, error_body(code, message, "backend", final_status)
