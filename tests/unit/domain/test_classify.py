from __future__ import annotations

import orjson
import pytest

from hivenet_router.domain.classify import classify, structured_code
from hivenet_router.domain.errors import ErrorCode, error_body


@pytest.mark.parametrize(
    ("status", "body", "code", "client_status"),
    [
        (
            400,
            b'{"error": {"message": "bad temp", "type": "invalid_request_error"}}',
            ErrorCode.INVALID_PARAMETER,
            400,
        ),
        (
            400,
            b'{"message": "Prompt is too long", "type": "context_length_exceeded"}',
            ErrorCode.CONTEXT_LENGTH_EXCEEDED,
            400,
        ),
        (
            400,
            b'{"error": {"message": "maximum context length is 10 tokens", "type": "x"}}',
            ErrorCode.CONTEXT_LENGTH_EXCEEDED,
            400,
        ),
        (422, b"plain text", ErrorCode.INVALID_PARAMETER, 400),
        # OpenAI-compatible servers name these invalid_request_error too; the status wins.
        (
            404,
            b'{"error": {"message": "no such model", "type": "invalid_request_error"}}',
            ErrorCode.MODEL_NOT_FOUND,
            404,
        ),
        (
            401,
            b'{"error": {"message": "Incorrect API key", "type": "invalid_request_error"}}',
            ErrorCode.BACKEND_ERROR,
            502,
        ),
        (
            500,
            b'{"error": {"message": "boom", "type": "invalid_request_error"}}',
            ErrorCode.BACKEND_ERROR,
            502,
        ),
        (  # older llama.cpp servers
            400,
            b'{"error": {"message": "the request exceeds the available context size, try'
            b' increasing it", "type": "exceed_context_size_error"}}',
            ErrorCode.CONTEXT_LENGTH_EXCEEDED,
            400,
        ),
        (429, b"slow down", ErrorCode.BACKEND_UNAVAILABLE, 503),
        (503, b"{}", ErrorCode.BACKEND_UNAVAILABLE, 503),
        (500, b"boom", ErrorCode.BACKEND_ERROR, 502),
        (
            404,
            b'{"error": {"message": "The model does not exist."}}',
            ErrorCode.MODEL_NOT_FOUND,
            404,
        ),
        # Found by a new user: an engine without /v1/messages/count_tokens answered 404,
        # read as the agent's failure, which opened its breaker for every client.
        (404, b'{"detail": "Not Found"}', ErrorCode.NOT_FOUND, 404),
        (
            400,
            b'{"type": "error", "error": {"type": "invalid_request_error", "message": '
            b'"prompt is too long: 300000 tokens > 200000 maximum"}}',
            ErrorCode.CONTEXT_LENGTH_EXCEEDED,
            400,
        ),
        (
            413,
            b'{"type": "error", "error": {"type": "request_too_large", "message": "big"}}',
            ErrorCode.REQUEST_TOO_LARGE,
            413,
        ),
        (
            529,
            b'{"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}',
            ErrorCode.BACKEND_UNAVAILABLE,
            503,
        ),
        (  # llama.cpp without a vision projector: the request's doing, never retried
            500,
            b'{"error": {"code": 500, "message": "image input is not supported - hint: '
            b'if this is unexpected, you may need to provide the mmproj"}}',
            ErrorCode.UNSUPPORTED_PARAMETER,
            400,
        ),
        (  # llama.cpp's embedding batch (found by a new user: it opened the breaker)
            500,
            b'{"error": {"code": 500, "message": "input (602 tokens) is too large to '
            b'process. increase the physical batch size (current batch size: 512)"}}',
            ErrorCode.CONTEXT_LENGTH_EXCEEDED,
            400,
        ),
    ],
)
def test_classify(status: int, body: bytes, code: ErrorCode, client_status: int) -> None:
    got, got_status, envelope = classify(status, body)
    assert (got, got_status) == (code, client_status)
    error = orjson.loads(envelope)["error"]
    assert error["code"] == code.value and error["source"] == "backend"
    assert structured_code(envelope) is code


def test_classify_truncates_long_messages() -> None:
    _, _, envelope = classify(500, b"x" * 5000)
    assert len(orjson.loads(envelope)["error"]["message"]) == 512


def test_structured_code_ignores_foreign_errors() -> None:
    assert structured_code(b'{"error": {"code": 400, "message": "x"}}') is None
    assert structured_code(b"not json") is None
    assert structured_code(error_body(ErrorCode.QUEUE_FULL, "x")) is ErrorCode.QUEUE_FULL
