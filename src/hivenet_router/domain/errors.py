"""The client-facing error codes, their HTTP statuses, and the JSON envelope.

Codes and statuses follow the documented interface of the Go router so that clients and
dashboards keep working. The envelope carries `code`, `message`, `type` (OpenAI clients read
it) and `source` (router or backend).

One envelope satisfies both official specifications: OpenAI's `ErrorResponse` (an `error`
object with `type`, `message`, `param` and `code`) and Anthropic's (top-level `"type":
"error"` and `request_id`, and an `error.type` from Anthropic's list, which every value of
`_TYPE` is). Each client reads the fields it knows and ignores the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import orjson


class ErrorCode(StrEnum):
    REQUEST_INVALID = "request_invalid"
    REQUEST_TOO_LARGE = "request_too_large"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    INVALID_PARAMETER = "invalid_parameter"
    INPUT_TOO_LONG = "input_too_long"
    UNAUTHORIZED = "unauthorized"
    MODEL_FORBIDDEN = "model_forbidden"
    MODEL_NOT_FOUND = "model_not_found"
    NOT_FOUND = "not_found"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    RATE_LIMIT_EXCEEDED = "rate_limit_exceeded"
    TOKEN_LIMIT_EXCEEDED = "token_limit_exceeded"
    CONCURRENCY_LIMIT_EXCEEDED = "concurrency_limit_exceeded"
    NO_AGENTS_AVAILABLE = "no_agents_available"
    NO_CAPACITY = "no_capacity"
    AGENT_DISCONNECTED = "agent_disconnected"
    BACKEND_UNAVAILABLE = "backend_unavailable"
    QUEUE_FULL = "queue_full"
    BACKEND_ERROR = "backend_error"
    REQUEST_TIMEOUT = "request_timeout"
    INSUFFICIENT_BALANCE = "insufficient_balance"
    DEGENERATE_OUTPUT = "degenerate_output"
    MALFORMED_OUTPUT = "malformed_output"
    # The Responses API (docs/responses.md).
    UNSUPPORTED_TOOL = "unsupported_tool"
    UNSUPPORTED_PARAMETER = "unsupported_parameter"
    RESPONSE_NOT_FOUND = "response_not_found"
    RESPONSE_NOT_CANCELLABLE = "response_not_cancellable"


STATUS: dict[ErrorCode, int] = {
    ErrorCode.REQUEST_INVALID: 400,
    ErrorCode.REQUEST_TOO_LARGE: 413,
    ErrorCode.CONTEXT_LENGTH_EXCEEDED: 400,
    ErrorCode.INVALID_PARAMETER: 400,
    ErrorCode.INPUT_TOO_LONG: 400,
    ErrorCode.UNAUTHORIZED: 401,
    ErrorCode.MODEL_FORBIDDEN: 403,
    ErrorCode.MODEL_NOT_FOUND: 404,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.METHOD_NOT_ALLOWED: 405,
    ErrorCode.RATE_LIMIT_EXCEEDED: 429,
    ErrorCode.TOKEN_LIMIT_EXCEEDED: 429,
    ErrorCode.CONCURRENCY_LIMIT_EXCEEDED: 429,
    ErrorCode.NO_AGENTS_AVAILABLE: 503,
    ErrorCode.NO_CAPACITY: 503,
    ErrorCode.AGENT_DISCONNECTED: 503,
    ErrorCode.BACKEND_UNAVAILABLE: 503,
    ErrorCode.QUEUE_FULL: 503,
    ErrorCode.BACKEND_ERROR: 502,
    ErrorCode.REQUEST_TIMEOUT: 504,
    ErrorCode.INSUFFICIENT_BALANCE: 402,
    ErrorCode.DEGENERATE_OUTPUT: 502,
    ErrorCode.MALFORMED_OUTPUT: 502,
    ErrorCode.UNSUPPORTED_TOOL: 400,
    ErrorCode.UNSUPPORTED_PARAMETER: 400,
    ErrorCode.RESPONSE_NOT_FOUND: 404,
    ErrorCode.RESPONSE_NOT_CANCELLABLE: 400,
}

# OpenAI SDKs read `type`; keep it a small, stable vocabulary.
_TYPE: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    431: "invalid_request_error",
    429: "rate_limit_error",
    502: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
}

# A request-level error would fail the same way on any agent: never retry it.
NON_RETRYABLE: frozenset[ErrorCode] = frozenset(
    {
        ErrorCode.REQUEST_INVALID,
        ErrorCode.CONTEXT_LENGTH_EXCEEDED,
        ErrorCode.INVALID_PARAMETER,
        ErrorCode.INPUT_TOO_LONG,
        ErrorCode.TOKEN_LIMIT_EXCEEDED,
        ErrorCode.REQUEST_TOO_LARGE,
        ErrorCode.UNSUPPORTED_TOOL,
        ErrorCode.UNSUPPORTED_PARAMETER,
        ErrorCode.NOT_FOUND,  # an engine without the route asked for (domain/classify.py)
    }
)

_BY_VALUE = {code.value: code for code in ErrorCode}


def code_from_str(value: str) -> ErrorCode | None:
    return _BY_VALUE.get(value)


@dataclass(frozen=True, slots=True)
class ApiError(Exception):
    """An error that ends a request with a structured response."""

    code: ErrorCode
    message: str
    source: str = "router"
    status: int | None = None
    param: str | None = None  # the request field at fault, when there is one

    @property
    def http_status(self) -> int:
        return self.status if self.status is not None else STATUS[self.code]

    def body(self, request_id: str | None = None) -> bytes:
        return error_body(
            self.code, self.message, self.source, self.http_status, request_id, self.param
        )

    def __str__(self) -> str:
        return f"{self.code.value}: {self.message}"


def error_body(
    code: ErrorCode,
    message: str,
    source: str = "router",
    status: int = 0,
    request_id: str | None = None,
    param: str | None = None,
) -> bytes:
    http_status = status or STATUS[code]
    return orjson.dumps(
        {
            "type": "error",
            "error": {
                "code": code.value,
                "message": message,
                "type": _TYPE.get(http_status, "api_error"),
                "param": param,
                "source": source,
            },
            "request_id": request_id,
        }
    )
