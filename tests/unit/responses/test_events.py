"""A chat stream as the Responses events."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hivenet_router.responses import events, translate
from hivenet_router.responses.events import StreamShape
from hivenet_router.responses.request import parse
from hivenet_router.responses.translate import skeleton


def _sse(*events: dict[str, Any]) -> bytes:
    return b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in events) + b"data: [DONE]\n\n"


def _read(data: bytes) -> list[dict[str, Any]]:
    out = []
    for event in data.split(b"\n\n"):
        if event:
            name, body = event.split(b"\n")
            decoded = orjson.loads(body[6:])
            assert name == b"event: " + decoded["type"].encode()
            out.append(decoded)
    return out


def _collect(into: list[dict[str, Any]]) -> Callable[[dict[str, Any], bytes], None]:
    return lambda response, _encoded: into.append(response)


def _delta(**delta: Any) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": None}]}


def test_events_in_order_whatever_the_chunking() -> None:
    chat = _sse(
        _delta(role="assistant", content=""),
        _delta(reasoning_content="hm"),
        _delta(content="Hel"),
        _delta(content="lo"),
        _delta(tool_calls=[{"index": 0, "id": "c", "function": {"name": "f", "arguments": "{"}}]),
        _delta(tool_calls=[{"index": 0, "function": {"arguments": "}"}}]),
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
        {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}},
    )
    request = parse(b'{"model": "m", "input": "x"}')
    for size in (1, 7, len(chat)):
        done: list[dict[str, Any]] = []
        shape = StreamShape(skeleton(request, "resp_1"), _collect(done))
        out = b"".join(shape(chat[i : i + size]) for i in range(0, len(chat), size))
        out += shape.flush()
        events = _read(out)
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        assert [e["type"] for e in events] == [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            "response.reasoning_text.delta",
            "response.reasoning_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.output_item.added",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.done",
            "response.output_item.done",
            "response.completed",
        ]
        final = events[-1]["response"]
        assert [i["type"] for i in final["output"]] == ["reasoning", "message", "function_call"]
        assert final["output"][1]["content"][0]["text"] == "Hello"
        assert final["output"][2]["arguments"] == "{}"
        assert final["usage"]["total_tokens"] == 7
        assert done == [final] and shape.finished


def test_an_engine_error_in_the_stream_fails_the_response() -> None:
    request = parse(b'{"model": "m", "input": "x"}')
    shape = StreamShape(skeleton(request, "resp_1"), lambda r, _: None)
    out = shape(_sse(_delta(content="a"), {"error": {"code": "oops", "message": "broke"}}))
    events = _read(out)
    assert events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["error"] == {"code": "oops", "message": "broke"}
    assert shape.flush() == b""


def test_a_stream_cut_without_done_still_ends() -> None:
    request = parse(b'{"model": "m", "input": "x"}')
    shape = StreamShape(skeleton(request, "resp_1"), lambda r, _: None)
    shape(b"data: " + orjson.dumps(_delta(content="a")) + b"\n\n")
    events = _read(shape.flush())
    assert events[-1]["type"] == "response.completed"


def test_odd_chat_events_are_skipped_not_raised() -> None:
    request = parse(b'{"model": "m", "input": "x"}')
    shape = StreamShape(skeleton(request, "resp_1"), lambda r, _: None)
    odd = [
        {"choices": [{"delta": {"tool_calls": [{"index": [1], "function": {"name": 3}}]}}]},
        {"choices": [{"delta": {"tool_calls": [5]}, "finish_reason": ["x"]}]},
        {
            "choices": [],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "completion_tokens_details": 7},
        },
        [1, 2],
    ]
    out = b"".join(shape(b"data: " + orjson.dumps(e) + b"\n\n") for e in odd) + shape.flush()
    assert _read(out)[-1]["type"] == "response.completed"


def test_every_event_is_the_bytes_the_general_writer_makes() -> None:
    """Delta events are written from bytes prepared when their item opens, the Response's
    events around the Response's JSON made once: each one is byte for byte the event
    `_event` writes from its fields (key order included), and the store is handed the
    bytes the last event carries."""
    chat = _sse(
        _delta(role="assistant", content='a\u00e9"\n'),
        _delta(reasoning_content="why"),
        _delta(content="b"),
        {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}},
    )
    kept: list[tuple[dict[str, Any], bytes]] = []
    request = parse(
        b'{"model": "m", "input": "x", "temperature": 0.5, "metadata": {"k": "\xc3\xa9"}}'
    )
    shape = StreamShape(skeleton(request, "resp_1"), lambda r, b: kept.append((r, b)))
    out = shape(chat) + shape.flush()
    events = [e for e in out.split(b"\n\n") if e]
    deltas = [e for e in events if b".delta" in e.split(b"\n", 1)[0]]
    assert len(deltas) == 3 and len(events) > 10
    [(final, encoded)] = kept
    assert encoded == orjson.dumps(final) and events[-1].endswith(b',"response":' + encoded + b"}")
    for raw in events:
        decoded = orjson.loads(raw.split(b"\ndata: ", 1)[1])
        kind = decoded.pop("type")
        again: list[bytes] = []
        shape._seq = decoded.pop("sequence_number")
        shape._event(again, kind, **decoded)
        assert again == [raw + b"\n\n"]
    assert [orjson.loads(e.split(b"\ndata: ", 1)[1])["delta"] for e in deltas] == [
        'a\u00e9"\n',
        "why",
        "b",
    ]


def _stream_out(chat: bytes, size: int, learn: bool, monkeypatch: pytest.MonkeyPatch) -> bytes:
    ids = iter(range(1000))
    monkeypatch.setattr(events, "new_id", lambda prefix: f"{prefix}_{next(ids)}")
    monkeypatch.setattr(translate, "time", SimpleNamespace(time=lambda: 1_700_000_000.0))
    shape = StreamShape(skeleton(parse(b'{"model": "m", "input": "x"}'), "resp_1"), _collect([]))
    if not learn:
        shape._tries = 0
    out = b"".join(shape(chat[i : i + size]) for i in range(0, len(chat), size))
    assert len(shape._slots) == (2 if learn else 0)  # a reasoning and a message shape
    return out + shape.flush()


def test_token_events_read_from_their_bytes_as_when_parsed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Once a stream's token events have a known shape they are read from their bytes
    (_slot): the events written are the same, byte for byte, as when each is parsed, for
    whatever the engine sends in the same shape or out of it."""
    head = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m"}

    def token(**delta: Any) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
        return {**head, "choices": [choice]}

    events_ = [
        token(role="assistant", content=""),
        token(reasoning_content="think"),
        token(reasoning_content=' "deep"\n'),
        token(content="Hel"),
        token(content="lo \u00e9\u4e2d\U0001f600"),
        token(content=""),
        token(content="m"),  # the model's name: found twice, not a shape to learn from
        token(content=None),
        token(content=7),
        token(content="x", reasoning_content=None),
        token(reasoning_content="again"),
        {**token(content="a"), "usage": {"prompt_tokens": 1, "completion_tokens": 2}},
        token(content="\\u0041 ", tool_calls=None),
        {**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
    ]
    compact = _sse(*events_)
    # An engine that writes JSON otherwise (Python's json: spaces, \u escapes).
    spaced = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events_)
    spaced += b"data: [DONE]\n\n"
    for chat in (compact, spaced, compact.replace(b'"content":"lo', b'"content": "lo')):
        for size in (1, 5, 64, len(chat)):
            fast = _stream_out(chat, size, True, monkeypatch)
            assert fast == _stream_out(chat, size, False, monkeypatch)
    text = [e["delta"] for e in _read(fast) if e["type"] == "response.output_text.delta"]
    assert text == ["Hel", "lo \u00e9\u4e2d\U0001f600", "m", "x", "a", "\\u0041 "]


_HEAD = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
_TEXTS = st.one_of(
    st.from_regex(r"[a-z ]{1,6}", fullmatch=True),  # the usual token
    st.from_regex(r"[a-z ]{1,6}", fullmatch=True),
    st.from_regex("[a-z \u00e9\u4e2d\U0001f600\u2028]{1,4}", fullmatch=True),
    st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7F), max_size=6),
    st.sampled_from(["", '"', "\\", "\n", "\u00e9", "\U0001f600", "\x7f", "a\tb", "\\u0041"]),
    st.text(max_size=3),
)
_EVENTS = st.lists(
    st.one_of(
        st.tuples(st.sampled_from(["content", "reasoning_content"]), _TEXTS),
        st.tuples(st.just("content"), _TEXTS),
        st.sampled_from(
            ["role", "other", "usage", "blank", "comment", "junk", "id", "split", "cut"]
        ),
    ),
    max_size=40,
)


def _chat_sse(events_: list[Any], spaced: bool, crlf: bool) -> bytes:
    out = []
    for event in events_:
        if event == "blank":  # an empty line between events: a third \n
            out.append(b"\n")
            continue
        if event == "comment":
            out.append(b": keep-alive\n\n")
            continue
        if event == "cut":  # a character cut between two tokens: neither is UTF-8
            cut = {"index": 0, "delta": {"content": "a"}, "logprobs": None, "finish_reason": None}
            token = orjson.dumps({**_HEAD, "choices": [cut]})  # the tokens' own shape
            out.append(b"data: " + token.replace(b'"a"', b'"a\xc3"') + b"\n\n")
            out.append(b"data: " + token.replace(b'"a"', b'"\xa9b"') + b"\n\n")
            continue
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if event == "role" else {}
        if isinstance(event, tuple):
            delta = {event[0]: event[1]}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
        body: dict[str, Any] = {**_HEAD, "choices": [choice]}
        if event == "other":
            body["system_fingerprint"] = "x"
        if event == "usage":
            body = {**_HEAD, "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2}}
        text = json.dumps(body).encode() if spaced else orjson.dumps(body)
        if event == "junk":  # not JSON once its line ends
            text = orjson.dumps({**_HEAD, "choices": [{**choice, "delta": {"content": "j"}}]})
            text += b"x"
        elif event == "split":  # on two data lines (joined by a line end: JSON whitespace)
            text = text.replace(b",", b"\ndata: ,", 1)
        elif event == "id":  # a token event with an id field
            text = orjson.dumps({**_HEAD, "choices": [{**choice, "delta": {"content": "i"}}]})
            text += b"\nid: 7"
        out.append(b"data: " + text + b"\n\n")
    out.append(b"data: [DONE]\n\n")
    data = b"".join(out)
    return data.replace(b"\n", b"\r\n") if crlf else data


def _counted_ids() -> Callable[[str], str]:
    ids = iter(range(1000))
    return lambda prefix: f"{prefix}_{next(ids)}"


@settings(max_examples=300, deadline=None)
@given(
    events_=_EVENTS,
    cuts=st.lists(st.integers(min_value=0, max_value=4000), max_size=20),
    spaced=st.booleans(),
    crlf=st.booleans(),
)
def test_token_runs_taken_whole_give_the_same_bytes(
    events_: list[Any], cuts: list[int], spaced: bool, crlf: bool
) -> None:
    """The runs of token events taken from the SSE bytes (StreamShape._run) write the same
    bytes as each event parsed, whatever the texts, the chunking and the events between."""
    chat = _chat_sse(events_, spaced, crlf)
    bounds = [0, *sorted(cut % (len(chat) + 1) for cut in cuts), len(chat)]
    chunks = [chat[a:b] for a, b in itertools.pairwise(bounds)]
    outs = []
    for learn in (True, False):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(events, "new_id", _counted_ids())
            patch.setattr(translate, "time", SimpleNamespace(time=lambda: 1_700_000_000.0))
            shape = StreamShape(
                skeleton(parse(b'{"model": "m", "input": "x"}'), "resp_1"), _collect([])
            )
            if not learn:
                shape._tries = 0
            outs.append(b"".join(shape(chunk) for chunk in chunks) + shape.flush())
    assert outs[0] == outs[1]


def test_a_character_cut_between_two_tokens_is_read_as_when_parsed() -> None:
    """Two token texts that are UTF-8 only together are each read as when parsed (both
    dropped: neither is JSON), in a run of tokens or at its start."""
    run = [("content", "Hel"), ("content", "lo"), "cut", ("content", "x")]
    for chat in (_chat_sse(run, False, False), _chat_sse([run[0], "cut", *run[1:]], False, False)):
        outs = []
        for learn in (True, False):
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(events, "new_id", _counted_ids())
                shape = StreamShape(
                    skeleton(parse(b'{"model": "m", "input": "x"}'), "resp_1"), _collect([])
                )
                if not learn:
                    shape._tries = 0
                head, rest = chat.split(b"\n\n", 1)  # the first token alone: then a run
                outs.append(shape(head + b"\n\n") + shape(rest) + shape.flush())
        assert outs[0] == outs[1]
        assert b'"delta":"x"' in outs[0] and b"\xc3" not in outs[0]


@pytest.mark.parametrize("late", [False, True])
def test_a_streamed_call_of_a_namespaces_function_names_its_namespace(late: bool) -> None:
    """As a whole answer's (test_translate): Codex runs an MCP tool's call only by its
    namespace; the name may come with the call's first delta or a later one."""
    namespace = {
        "type": "namespace",
        "name": "mcp__docs",
        "tools": [{"type": "function", "name": "search"}],
    }
    body = {"model": "m", "input": "x", "tools": [namespace]}
    request = parse(orjson.dumps(body))
    first: dict[str, Any] = {"index": 0, "id": "c", "function": {"arguments": ""}}
    if not late:
        first["function"]["name"] = "search"
    second: dict[str, Any] = {"index": 0, "function": {"arguments": "{}"}}
    if late:
        second["function"]["name"] = "search"
    chat = _sse(
        _delta(tool_calls=[first]),
        _delta(tool_calls=[second]),
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
    )
    shape = StreamShape(skeleton(request, "resp_1"), lambda r, _: None)
    events = _read(shape(chat) + shape.flush())
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [(i["namespace"], i["name"]) for i in done] == [("mcp__docs", "search")]
    final = events[-1]["response"]["output"][0]
    assert (final["namespace"], final["name"], final["arguments"]) == ("mcp__docs", "search", "{}")
    if not late:
        added = next(e for e in events if e["type"] == "response.output_item.added")
        assert added["item"]["namespace"] == "mcp__docs"
