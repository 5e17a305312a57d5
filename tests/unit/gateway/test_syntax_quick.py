"""The syntax judge's shortcut (gateway/syntax_quick.py) reads what parsing reads: fed the same
bytes, a judge that reads plain events without parsing them and one that parses every event
reach the same verdict, at the same event, and hand the loop detector the same text,
whatever the pieces hold (quotes, escapes, control characters, text beyond the BMP) and
however a line is broken (a byte changed or cut, another JSON writer, CRLF)."""

from __future__ import annotations

import json
from typing import Any

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from hivenet_router.gateway.settings import SyntaxSettings
from hivenet_router.gateway.sse_text import SseText
from hivenet_router.gateway.syntax import CHAT, MESSAGES, SyntaxJudge, asked
from hivenet_router.gateway.syntax_quick import Template, chat_template
from tests.unit.gateway.test_jsonprefix import documents

SCHEMA = {"type": "object", "required": ["a"], "properties": {"a": {"type": "array"}}}
ENVELOPE = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}


class Parsing(SyntaxJudge):
    """The judge without its shortcut: every event parsed."""

    __slots__ = ()

    def quick(self, payload: bytes) -> str | None:
        return None


def line(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    return {**ENVELOPE, "choices": [choice]}


def events(pieces: list[str], tool: bool) -> list[dict[str, Any]]:
    if not tool:
        body = [line({"content": piece}) for piece in pieces]
        return [line({"role": "assistant"}), *body, line({}, "stop")]
    head = {"index": 0, "id": "call_1", "type": "function"}
    opened = {**head, "function": {"name": "plan", "arguments": ""}}
    body = [line({"tool_calls": [{"index": 0, "function": {"arguments": p}}]}) for p in pieces]
    return [line({"tool_calls": [opened]}), *body, line({}, "tool_calls")]


def blocks(pieces: list[str], tool: bool) -> list[dict[str, Any]]:
    """The same answer as Anthropic streams it."""
    if tool:
        block = {"type": "tool_use", "id": "toolu_1", "name": "plan", "input": {}}
        body = [{"type": "input_json_delta", "partial_json": piece} for piece in pieces]
    else:
        block = {"type": "text", "text": ""}
        body = [{"type": "text_delta", "text": piece} for piece in pieces]
    stop = "tool_use" if tool else "end_turn"
    return [
        {"type": "message_start", "message": {"id": "msg_1", "role": "assistant"}},
        {"type": "content_block_start", "index": 0, "content_block": block},
        *({"type": "content_block_delta", "index": 0, "delta": delta} for delta in body),
        {"type": "content_block_stop", "index": 0},
        {"type": "message_delta", "delta": {"stop_reason": stop}},
        {"type": "message_stop"},
    ]


def written(event: dict[str, Any], how: int) -> bytes:
    """An event's bytes as different engines write them."""
    if how == 1:
        return json.dumps(event).encode()  # spaces after separators, non-ASCII escaped
    if how == 2:
        return orjson.dumps(event) + b"\r"
    return orjson.dumps(event)


BREAKS = [b'"', b"\\", b"\x01", b"\xff", b"\xc3", b"\\u", b"\\ud800", b'\\"', b"\xe2\x82", b"}"]


def judged(judge: SyntaxJudge, lines: list[bytes]) -> tuple[Any, ...]:
    text = SseText(judge)
    pieces = [text.feed(chunk) for chunk in lines]
    reason = judge.finish()
    return reason, judge.check, pieces, text.done


@settings(max_examples=600, deadline=None)
@given(
    st.one_of(
        st.lists(st.text(max_size=6), max_size=30),
        documents().map(lambda doc: [doc[i : i + 3] for i in range(0, len(doc), 3)]),
    ),
    st.booleans(),
    st.booleans(),
    st.lists(st.integers(0, 2), min_size=1, max_size=4),
    st.lists(st.tuples(st.integers(0, 40), st.integers(0, 400), st.sampled_from(BREAKS))),
)
def test_reading_without_a_parse_reaches_the_parsed_verdict(
    pieces: list[str],
    tool: bool,
    anthropic: bool,
    writers: list[int],
    breaks: list[tuple[int, int, bytes]],
) -> None:
    if anthropic:
        tools: Any = [{"name": "plan", "input_schema": SCHEMA}]
        fmt = {"output_format": {"type": "json_schema", "schema": SCHEMA}}
        route, answer = MESSAGES, blocks(pieces, tool)
    else:
        tools = [{"type": "function", "function": {"name": "plan", "parameters": SCHEMA}}]
        fmt = {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}
        route, answer = CHAT, events(pieces, tool)
    form = asked(route, orjson.dumps({"tools": tools} if tool else fmt))
    assert form is not None
    bodies = [written(e, writers[n % len(writers)]) for n, e in enumerate(answer)]
    for number, at, what in breaks:
        if number < len(bodies):
            body = bodies[number]
            bodies[number] = body[:at] + what + body[at + 1 :]
    lines = []
    for event, body in zip(answer, bodies, strict=True):
        named = f"event: {event.get('type')}\n".encode() if anthropic else b""
        lines.append(named + b"data: " + body + b"\n\n")
    lines += [] if anthropic else [b"data: [DONE]\n\n"]
    quick, parsing = SyntaxJudge(form, SyntaxSettings()), Parsing(form, SyntaxSettings())
    assert judged(quick, lines) == judged(parsing, lines)


class Counting(SyntaxJudge):
    """The judge, noting for each payload whether it was read without a parse."""

    __slots__ = ("read",)

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.read: list[bool] = []

    def quick(self, payload: bytes) -> str | None:
        piece = super().quick(payload)
        self.read.append(piece is not None)
        return piece


def test_a_plain_stream_is_read_without_parsing_after_its_second_piece() -> None:
    form = asked(CHAT, orjson.dumps({"response_format": {"type": "json_object"}}))
    assert form is not None
    judge = Counting(form, SyntaxSettings())
    text = SseText(judge)
    chunks = ['{"a"', ": [1", ', "x\\"y', '\u00e9\U0001f600"', "]}"]
    for event in events(chunks, tool=False):
        content = event["choices"][0]["delta"].get("content")
        got = text.feed(b"data: " + orjson.dumps(event) + b"\n\n")
        assert got == ([content] if content else [])
    # The role; the first piece (its text opens there) and the second (its shape is kept
    # then) parsed; the next three read from their bytes; the finish, another shape, parsed.
    assert judge.read == [False, False, False, True, True, True, False]
    assert judge.finish() is None


def test_no_shortcut_for_bytes_orjson_would_not_write() -> None:
    event = line({"content": "{"})
    doc: Any = object()
    assert chat_template(json.dumps(event).encode(), event, doc, True) is None
    shape = chat_template(b" " + orjson.dumps(event), event, doc, True)
    assert isinstance(shape, Template)
    assert shape.piece(b" " + orjson.dumps(line({"content": '"\u00e9\\'}))) == '"\u00e9\\'
    assert shape.piece(b" " + orjson.dumps(line({"content": "x"}, "stop"))) is None
    # A bare quote, a control character, a bad escape, invalid UTF-8: parsed instead.
    for bad in (b'"', b"\x01", b"\\x", b"\xff", b"\\ud800"):
        assert shape.piece(shape.head + bad + shape.tail) is None


def test_an_anthropic_tool_input_is_read_without_parsing() -> None:
    form = asked(MESSAGES, orjson.dumps({"tools": [{"name": "plan", "input_schema": SCHEMA}]}))
    assert form is not None
    judge = Counting(form, SyntaxSettings())
    text = SseText(judge)
    for event in blocks(['{"a"', ": [1", ", 2", "]}"], tool=True):
        text.feed(b"event: x\ndata: " + orjson.dumps(event) + b"\n\n")
    # The tool opens at its block's start: its first piece is parsed, the rest read as bytes.
    assert judge.read == [False, False, False, True, True, True, False, False, False]
    assert judge.finish() is None


def test_an_event_too_deep_for_orjson_to_write_is_parsed_not_templated() -> None:
    # orjson reads 1,024 levels but writes 255: such an event gets no shortcut, no error.
    form = asked(CHAT, orjson.dumps({"response_format": {"type": "json_object"}}))
    assert form is not None
    judge = SyntaxJudge(form, SyntaxSettings())
    text = SseText(judge)
    deep = b"[" * 300 + b"]" * 300
    text.feed(b'data: {"choices":[{"delta":{"content":"{"}}]}\n\n')
    assert text.feed(b'data: {"choices":[{"delta":{"content":"}"}}],"x":' + deep + b"}\n\n") == [
        "}"
    ]
    assert judge.finish() is None


def test_a_message_stop_with_choices_still_ends_the_answer() -> None:
    form = asked(MESSAGES, orjson.dumps({"output_format": {"type": "json_schema", "schema": {}}}))
    assert form is not None
    text = SseText(SyntaxJudge(form, SyntaxSettings()))
    text.feed(b'data: {"type":"message_stop","choices":[]}\n\n')
    assert text.done
