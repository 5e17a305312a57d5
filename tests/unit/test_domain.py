from __future__ import annotations

import orjson
import pytest

from hivenet_router.domain.classify import classify, structured_code
from hivenet_router.domain.errors import ErrorCode, error_body
from hivenet_router.router.usage import StreamMeter, from_body


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
        (429, b"slow down", ErrorCode.BACKEND_UNAVAILABLE, 503),
        (503, b"{}", ErrorCode.BACKEND_UNAVAILABLE, 503),
        (500, b"boom", ErrorCode.BACKEND_ERROR, 502),
        (
            404,
            b'{"error": {"message": "The model does not exist."}}',
            ErrorCode.MODEL_NOT_FOUND,
            404,
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


def test_usage_from_body() -> None:
    body = b'{"usage": {"prompt_tokens": 3, "completion_tokens": 5}}'
    usage = from_body(body)
    assert usage is not None and (usage.input_tokens, usage.output_tokens) == (3, 5)
    assert from_body(b'{"choices": []}') is None
    anthropic = from_body(b'{"usage": {"input_tokens": 4, "output_tokens": 2}}')
    assert anthropic is not None and anthropic.output_tokens == 2


def test_stream_meter_openai_and_anthropic() -> None:
    meter = StreamMeter()
    meter.feed(b'data: {"choices": [{"delta": {"content": "a"}}]}\n\n')
    for _ in range(10):
        meter.feed(b'data: {"choices": [{"delta": {"content": "b"}}]}\n\n')
    meter.feed(
        b'data: {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 11}}'
        b"\n\ndata: [DONE]\n\n"
    )
    usage = meter.result()
    assert usage is not None and (usage.input_tokens, usage.output_tokens) == (9, 11)

    meter = StreamMeter()
    meter.feed(
        b'event: message_start\ndata: {"type": "message_start", "message": '
        b'{"usage": {"input_tokens": 7, "output_tokens": 1}}}\n\n'
    )
    meter.feed(
        b'event: message_delta\ndata: {"type": "message_delta", "usage": {"output_tokens": 20}}\n\n'
    )
    usage = meter.result()
    assert usage is not None and (usage.input_tokens, usage.output_tokens) == (7, 20)
    assert StreamMeter().result() is None


def test_router_validation_follows_the_official_schemas() -> None:
    """The router refuses only what it must interpret and the official schemas refuse too;
    everything else (tools, formats, fields yet to come) is the engine's to judge."""
    from hivenet_router.router.bodies import parse

    chat = parse(
        "/v1/chat/completions",
        b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -1,'
        b' "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto",'
        b' "response_format": {"type": "json_object"}, "stream_options": null}',
    )
    assert chat.max_output_tokens is None  # negative: undeclared
    assert chat.text_bytes == 2 + len(b'[{"type": "function", "function": {"name": "f"}}]')
    assert parse("/v1/completions", b'{"model": "m", "prompt": null}').text_bytes == 0
    assert parse("/v1/messages", b'{"model": "m", "messages": [], "max_tokens": 1}').messages == 0
    agentic = parse(
        "/v1/messages",
        b'{"model": "m", "max_tokens": 5, "system": [{"type": "text", "text": "abc"}],'
        b' "messages": [{"role": "assistant", "content": [{"type": "thinking", "thinking":'
        b' "hmm"}, {"type": "tool_use", "id": "t", "name": "f", "input": {"a": 1}}]},'
        b' {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",'
        b' "content": [{"type": "text", "text": "result"}, {"type": "image", "source": {}}]}]}]}',
    )
    assert agentic.text_bytes == len("abc") + len("hmm") + len('{"a":1}') + len("result")
    assert agentic.images == 1 and agentic.messages == 2
