"""The validator's syntax judging: a local answer whose JSON, tool-call arguments or events
break is replaced like a loop (within the hold) or ends with `malformed_output` (after it);
sound structured answers pass byte for byte; free text is not judged unless asked; the
policy's `syntax` switches parse. Same scripted answers and fakes as test_validator.py."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hivenet_router.domain.answer import Answer, Outcome, Whole
from hivenet_router.domain.request import Job
from hivenet_router.gateway.blocks import VALIDATOR
from hivenet_router.gateway.settings import (
    SYNTAX_ALL,
    SYNTAX_OFF,
    SyntaxSettings,
    ValidatorSettings,
)
from hivenet_router.gateway.sse_text import SseText
from hivenet_router.gateway.syntax import CHAT, Asked, SyntaxJudge, asked
from hivenet_router.gateway.validator import REPLACED, REPLACED_REASON
from hivenet_router.observability.events import Observers
from hivenet_router.pipeline.ticket import Ticket
from hivenet_router.policy.reader import PolicyError
from tests.unit.gateway.test_blocks import parse
from tests.unit.gateway.test_jsonprefix import documents
from tests.unit.gateway.test_validator import (
    END,
    Cloud,
    Dispatch,
    Local,
    count,
    policy,
    relay,
    stage,
)

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
JSON_REQUEST = {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}
TOOL_REQUEST = {"tools": [{"type": "function", "function": {"name": "trip", "parameters": SCHEMA}}]}
SETTINGS = ValidatorSettings(hold_chunks=15)
FREE = Asked(CHAT)


def ticket(
    request: dict[str, Any], route: str = "/v1/chat/completions", stream: bool = True
) -> Ticket:
    t = Ticket("rid", route, 0.0, Observers())
    t.job = Job(route, "m", "llm", stream, orjson.dumps({"model": "m", **request}), [])
    return t


def content(text: str, finish: str | None = None) -> bytes:
    choice = {"index": 0, "delta": {"content": text}, "finish_reason": finish}
    return b"data: " + orjson.dumps({"choices": [choice]}) + b"\n\n"


def call_args(text: str, name: str | None = None) -> bytes:
    function: dict[str, Any] = {"arguments": text}
    if name:
        function["name"] = name
    delta = {"tool_calls": [{"index": 0, "function": function}]}
    return b"data: " + orjson.dumps({"choices": [{"index": 0, "delta": delta}]}) + b"\n\n"


def finish(reason: str = "stop") -> bytes:
    return content("", reason)


def pieces(text: str, size: int = 3) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


def json_stream(text: str, reason: str = "stop") -> list[bytes]:
    return [content(p) for p in pieces(text)] + [finish(reason), END]


GOOD = '{"city": "Oslo", "days": 3}'


async def test_a_sound_json_answer_passes_byte_for_byte() -> None:
    local = Local(json_stream(GOOD), "peer-a")
    validator = stage(policy(SETTINGS), Cloud())
    answer = await validator(ticket(JSON_REQUEST), Dispatch(local.answer))
    body, outcome = await relay(answer)
    assert body == local.bytes and outcome is Outcome.OK
    assert count(validator, "streams", "clean") == 1


@pytest.mark.parametrize(
    ("text", "check", "why"),
    [
        ('{"city": "Oslo",, "days": 3}', "json", "json: the answer is no JSON from character 16"),
        ('{"city": "Oslo", "days": "3"}', "schema", "schema: the answer: $.days: expected integer"),
        ('{"city": "Oslo"}', "schema", "schema: the answer: $: missing required property 'days'"),
        ('{"city": "Oslo", "days": 3', "json", "json: the answer: the JSON ends unfinished"),
    ],
)
async def test_broken_json_within_the_hold_goes_to_the_provider(
    text: str, check: str, why: str
) -> None:
    local = Local(json_stream(text), "peer-a")
    cloud = Cloud()
    validator = stage(policy(SETTINGS), cloud)
    t = ticket(JSON_REQUEST)
    answer = await validator(t, Dispatch(local.answer))
    assert answer is cloud.result and cloud.calls == 1
    assert local.closed_once(Outcome.BROKEN)
    assert t.noted(REPLACED) == "syntax"
    reason = t.noted(REPLACED_REASON)
    assert reason is not None and reason.startswith(why), reason
    assert count(validator, "streams", "syntax") == 1
    assert count(validator, "syntax", check) == 1


async def test_an_answer_cut_by_its_token_limit_is_not_unfinished() -> None:
    local = Local(json_stream('{"city": "Os', reason="length"), "peer-a")
    validator = stage(policy(SETTINGS), Cloud())
    answer = await validator(ticket(JSON_REQUEST), Dispatch(local.answer))
    body, outcome = await relay(answer)
    assert body == local.bytes and outcome is Outcome.OK


async def test_a_late_syntax_failure_ends_the_stream_with_malformed_output() -> None:
    chunks = json_stream('{"city": "Oslo", "days": 3}}')
    local = Local(chunks, "peer-a")
    validator = stage(policy(ValidatorSettings(hold_chunks=2)), Cloud())
    answer = await validator(ticket(JSON_REQUEST), Dispatch(local.answer))
    body, outcome = await relay(answer)
    assert outcome is Outcome.BROKEN
    sent = b"".join(chunks[:9])  # up to the chunk with the stray brace, which is withheld
    assert body == sent, (body, sent)
    assert local.closed_once(Outcome.BROKEN)
    assert count(validator, "streams", "late_syntax") == 1
    assert count(validator, "syntax", "json") == 1


async def test_tool_call_arguments_are_judged_against_the_tool() -> None:
    bad = [call_args("", "trip"), *(call_args(p) for p in pieces('{"city": 7, "days": 1}'))]
    local = Local([*bad, finish("tool_calls"), END], "peer-a")
    cloud = Cloud()
    validator = stage(policy(SETTINGS), cloud)
    t = ticket(TOOL_REQUEST)
    assert await validator(t, Dispatch(local.answer)) is cloud.result
    assert (
        t.noted(REPLACED_REASON) == "schema: trip's arguments: $.city: expected string, got number"
    )
    good = [call_args("", "trip"), *(call_args(p) for p in pieces(GOOD))]
    local = Local([*good, finish("tool_calls"), END], "peer-a")
    answer = await stage(policy(SETTINGS), Cloud())(ticket(TOOL_REQUEST), Dispatch(local.answer))
    body, outcome = await relay(answer)
    assert body == local.bytes and outcome is Outcome.OK


async def test_anthropic_tool_use_with_broken_input_is_replaced() -> None:
    def event(kind: str, **fields: Any) -> bytes:
        return f"event: {kind}\ndata: ".encode() + orjson.dumps({"type": kind, **fields}) + b"\n\n"

    block = {"type": "tool_use", "id": "t1", "name": "trip", "input": {}}
    chunks = [
        event("message_start", message={}),
        event("content_block_start", index=0, content_block=block),
        event(
            "content_block_delta",
            index=0,
            delta={"type": "input_json_delta", "partial_json": '{"city"'},
        ),
        event(
            "content_block_delta",
            index=0,
            delta={"type": "input_json_delta", "partial_json": ' "Oslo"}'},
        ),
        event("content_block_stop", index=0),
        event("message_delta", delta={"stop_reason": "tool_use"}),
        event("message_stop"),
    ]
    tools = {"tools": [{"name": "trip", "input_schema": SCHEMA}]}
    local = Local(chunks, "peer-a")
    cloud = Cloud()
    t = ticket(tools, route="/v1/messages")
    assert await stage(policy(SETTINGS), cloud)(t, Dispatch(local.answer)) is cloud.result
    assert t.noted(REPLACED_REASON) == "tool_args: trip's arguments is no JSON from character 8"


async def test_free_text_is_judged_only_when_the_policy_says_so() -> None:
    broken = [content("Hello"), b"garbage line\n\n", content(" there"), finish(), END]
    local = Local(broken, "peer-a")
    answer = await stage(policy(SETTINGS), Cloud())(ticket({}), Dispatch(local.answer))
    body, outcome = await relay(answer)
    assert body == local.bytes and outcome is Outcome.OK
    settings = ValidatorSettings(syntax=SYNTAX_ALL)
    local = Local(broken, "peer-a")
    cloud = Cloud()
    t = ticket({})
    assert await stage(policy(settings), cloud)(t, Dispatch(local.answer)) is cloud.result
    assert t.noted(REPLACED_REASON) == "events: a line that is no SSE field"
    # And structure is not judged when the policy turns syntax off.
    local = Local(json_stream("{{"), "peer-a")
    off = policy(ValidatorSettings(syntax=SYNTAX_OFF))
    answer = await stage(off, Cloud())(ticket(JSON_REQUEST), Dispatch(local.answer))
    assert (await relay(answer))[1] is Outcome.OK


async def test_a_whole_answer_is_judged_before_it_is_returned() -> None:
    def whole(text: str) -> Answer:
        message = {"role": "assistant", "content": text}
        body = orjson.dumps(
            {"choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}
        )
        return Answer(
            200, [("content-type", "application/json")], Whole(), body=body, origin="peer-a"
        )

    cloud = Cloud()
    validator = stage(policy(SETTINGS), cloud)
    sound = whole(GOOD)
    assert await validator(ticket(JSON_REQUEST, stream=False), Dispatch(sound)) is sound
    t = ticket(JSON_REQUEST, stream=False)
    assert (
        await validator(t, Dispatch(whole('{"city": "Oslo", "days": 3, "x": 1}'))) is cloud.result
    )
    assert t.noted(REPLACED_REASON) == "schema: the answer: $: property 'x' is not allowed"


def test_the_judge_reads_the_request_once_and_knows_what_it_asks() -> None:
    form = asked("/v1/chat/completions", orjson.dumps({"response_format": {"type": "json_object"}}))
    assert form is not None and form.json and form.object_only and form.structured
    form = asked(
        "/v1/messages", orjson.dumps({"output_format": {"type": "json_schema", "schema": SCHEMA}})
    )
    assert form is not None and form.schema == SCHEMA
    form = asked(
        "/v1/responses",
        orjson.dumps({"text": {"format": {"type": "json_schema", "schema": SCHEMA}}}),
    )
    assert form is not None and form.schema == SCHEMA
    free = asked("/v1/chat/completions", b'{"messages": []}')
    assert free is not None and not free.structured
    assert not SyntaxJudge(free, SyntaxSettings()).active
    assert asked("/v1/embeddings", b"{}") is None
    judge = SyntaxJudge(
        asked("/v1/chat/completions", b'{"response_format": {"type": "json_object"}}') or free,
        SyntaxSettings(),
    )
    judge.event({"choices": [{"index": 0, "delta": {"content": "[1]"}}]})
    assert judge.reason == "json: the answer is no JSON from character 0" and judge.check == "json"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "stream_validator: {syntax: {free_text: true, schema: false}}\n",
            SyntaxSettings(free_text=True, schema=False),
        ),
        ("stream_validator: {syntax: false}\n", SYNTAX_OFF),
        ("stream_validator: {syntax: true, hold_chunks: 3}\n", SYNTAX_ALL),
        ("stream_validator: {syntax: }\n", SyntaxSettings()),
    ],
)
def test_the_policy_switches_parse(text: str, expected: SyntaxSettings) -> None:
    settings = parse(text).block(VALIDATOR)
    assert settings is not None and settings.syntax == expected


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        (
            "stream_validator: {syntax: {colour: red}}\n",
            r"p\.yaml:2: stream_validator\.syntax\.colour: unknown field",
        ),
        (
            "stream_validator: {syntax: {json: 1}}\n",
            r"p\.yaml:2: stream_validator\.syntax\.json: must be true or false",
        ),
        (
            "stream_validator: {syntax: maybe}\n",
            r"p\.yaml:2: stream_validator\.syntax: must be true, false",
        ),
    ],
)
def test_policy_mistakes_name_the_switch(text: str, needle: str) -> None:
    with pytest.raises(PolicyError, match=needle):
        parse(text)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_any_valid_json_stream_cut_anywhere_is_never_judged_broken(data: st.DataObject) -> None:
    """A valid document sent as deltas of any size, in SSE bytes cut at any byte (inside
    a multi-byte character too): the judge sees no fault, and at the end a whole value."""
    text = data.draw(documents())
    sizes = data.draw(st.lists(st.integers(1, 9), min_size=1, max_size=8))
    deltas, at = [], 0
    while at < len(text):
        size = sizes[len(deltas) % len(sizes)]
        deltas.append(text[at : at + size])
        at += size
    stream = b"".join(content(d) for d in deltas) + finish() + END
    cuts = sorted(set(data.draw(st.lists(st.integers(0, len(stream)), max_size=20))))
    judge = SyntaxJudge(
        asked(CHAT, b'{"response_format": {"type": "json_schema"}}') or FREE, SyntaxSettings()
    )
    sse = SseText(judge)
    start = 0
    for cut in [*cuts, len(stream)]:
        sse.feed(stream[start:cut])
        start = cut
        assert judge.reason is None, (text, cut)
    assert sse.done and judge.finish() is None


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_any_event_or_body_is_judged_without_raising(data: st.DataObject) -> None:
    """Whatever an engine sends (any JSON where an event or a body goes, in any route's
    shape), the judge gives a verdict and never raises."""
    leaf = st.none() | st.booleans() | st.integers() | st.text(max_size=5)
    keys = st.sampled_from(
        ["choices", "delta", "message", "content", "index", "tool_calls", "function",
         "arguments", "name", "finish_reason", "type", "text", "partial_json",
         "content_block", "stop_reason", "error", "item", "output", "input"]
    )  # fmt: skip
    value = st.recursive(
        leaf, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(keys, inner, max_size=4)
    )
    route = data.draw(st.sampled_from(["/v1/chat/completions", "/v1/messages", "/v1/responses"]))
    form = Asked(route, json=True, schema=SCHEMA, tools={"trip": SCHEMA})
    judge = SyntaxJudge(form, SyntaxSettings())
    for event in data.draw(st.lists(value, max_size=6)):
        judge.event(event)
    judge.finish()
    SyntaxJudge(form, SyntaxSettings()).body(data.draw(value))
