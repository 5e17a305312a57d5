from __future__ import annotations

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hivenet_router.domain.answer import Answer, Outcome, Whole
from hivenet_router.domain.request import Usage
from hivenet_router.domain.usage import (
    USAGE_WINDOW,
    StreamMeter,
    TextMeter,
    UsageEvents,
    ask_for_usage,
    body_text_bytes,
    from_body,
    stream_input_tokens,
)


def test_usage_from_body() -> None:
    body = b'{"usage": {"prompt_tokens": 3, "completion_tokens": 5}}'
    usage = from_body(body)
    assert usage is not None and (usage.input_tokens, usage.output_tokens) == (3, 5)
    assert from_body(b'{"choices": []}') is None
    anthropic = from_body(b'{"usage": {"input_tokens": 4, "output_tokens": 2}}')
    assert anthropic is not None and anthropic.output_tokens == 2


def test_usage_is_read_from_the_top_level_key_only() -> None:
    cases = {
        # with nested details
        b'{"id": "x", "choices": [{"message": {"content": "usage: {}"}}], "usage": '
        b'{"prompt_tokens": 7, "prompt_tokens_details": {"cached_tokens": 2}, '
        b'"completion_tokens": 9, "total_tokens": 16}}\n': (7, 9),
        # not the last member
        b'{"usage": {"prompt_tokens": 1, "completion_tokens": 2}, "model": "m"}': (1, 2),
        # a "usage" key nested deeper than the top level counts for nothing
        b'{"choices": [], "meta": {"usage": {"prompt_tokens": 5}}}': None,
        # a key that only ends in "usage" (an escaped quote before it) is not usage
        b'{"x \\"usage": {"prompt_tokens": 99}}': None,
        # a string with braces inside the usage object
        b'{"usage": {"note": "a}b", "input_tokens": 3, "output_tokens": 4}}': (3, 4),
        b'{"usage": null}': None,
        b'{"usage": {"prompt_tokens": 1}': None,  # truncated: not JSON
    }
    for body, expected in cases.items():
        usage = from_body(body)
        got = None if usage is None else (usage.input_tokens, usage.output_tokens)
        assert got == expected, body


def test_anthropic_input_counts_what_the_prompt_cache_read_and_wrote() -> None:
    """Anthropic's input_tokens leaves the cache out, OpenAI's prompt_tokens does not: on
    /v1/messages a resent conversation counted only its new tokens (found by a new user
    on llama.cpp: 5 counted of 312)."""
    cases = {
        b'{"usage": {"input_tokens": 5, "cache_read_input_tokens": 307, "output_tokens": 2}}': (
            312,
            2,
        ),
        b'{"usage": {"input_tokens": 5, "cache_creation_input_tokens": 10,'
        b' "cache_read_input_tokens": 0, "output_tokens": 2}}': (15, 2),
        b'{"usage": {"input_tokens": 5, "cache_read_input_tokens": null, "output_tokens": 1}}': (
            5,
            1,
        ),
        # OpenAI's prompt_tokens already holds its cached tokens
        b'{"usage": {"prompt_tokens": 9, "cache_read_input_tokens": 7, "completion_tokens": 1}}': (
            9,
            1,
        ),
    }
    for body, expected in cases.items():
        usage = from_body(body)
        assert usage is not None and (usage.input_tokens, usage.output_tokens) == expected, body
    start = (
        b'event: message_start\ndata: {"type": "message_start", "message": {"usage": '
        b'{"input_tokens": 5, "cache_read_input_tokens": 307, "output_tokens": 1}}}\n\n'
    )
    assert stream_input_tokens(start) == 312


def test_usage_members_are_read_as_they_are_named() -> None:
    cases = {
        # a null count is the count given: it does not fall back to the other name
        b'{"usage": {"prompt_tokens": null, "input_tokens": 5, "completion_tokens": 2}}': (0, 2),
        # counts that are not non-negative integers count as zero
        b'{"usage": {"prompt_tokens": true, "completion_tokens": -3}}': (0, 0),
        b'{"usage": {"prompt_tokens": 1.5, "completion_tokens": "4"}}': (0, 0),
        b'{"usage": {"prompt_tokens": 99999999999999999999999, "completion_tokens": 1}}': (0, 1),
        b'{"usage": {"prompt_tokens": 18446744073709551615, "completion_tokens": 1}}': (
            2**64 - 1,
            1,
        ),
        b'{"usage": {"prompt_tokens": 18446744073709551616, "completion_tokens": 1}}': (0, 1),
        # the last of repeated members counts, whatever the earlier ones hold
        b'{"usage": {"prompt_tokens": 1}, "usage": {"completion_tokens": 4}}': (0, 4),
        b'{"usage": [1], "usage": {"prompt_tokens": 2, "completion_tokens": 3}}': (2, 3),
        b'{"usage": {"prompt_tokens": 2}, "usage": null}': None,
        # a stray invalid byte in the text does not hide the usage
        b'{"text": "\xff", "usage": {"prompt_tokens": 1, "completion_tokens": 2}}': (1, 2),
        b' {"usage": {"input_tokens": 1, "output_tokens": 2}} \n': (1, 2),
        b'{"usage": {}}': None,
        b'{"usage": [1, 2]}': None,
        b'{"usage": "many"}': None,
        b'[{"usage": {"prompt_tokens": 1}}]': None,
    }
    for body, expected in cases.items():
        usage = from_body(body)
        got = None if usage is None else (usage.input_tokens, usage.output_tokens)
        assert got == expected, body


def test_an_answer_nested_too_deep_has_no_usage_and_raises_nothing() -> None:
    deep = b'{"x": ' + b"[" * 5000 + b"]" * 5000 + b', "usage": {"prompt_tokens": 1}}'
    assert from_body(deep) is None


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


def test_stream_input_tokens_from_message_start() -> None:
    first = (
        b'event: message_start\ndata: {"type": "message_start", "message": '
        b'{"usage": {"input_tokens": 80, "output_tokens": 1}}}\n\n'
    )
    assert stream_input_tokens(first) == 80
    assert stream_input_tokens(b'data: {"choices": []}\n\n') is None


def test_the_router_asks_for_usage_only_when_the_client_did_not() -> None:
    plain = b'{"model": "m", "stream": true, "messages": []}\n'
    assert ask_for_usage(plain) == (
        b'{"model": "m", "stream": true, "messages": [],"stream_options":{"include_usage":true}}\n'
    )
    # the client's own options are kept; an escaped key is read as the engine reads it
    other = ask_for_usage(b'{"model": "m", "stream_options": {"continuous_usage_stats": false}}')
    assert other is not None and orjson.loads(other)["stream_options"] == {
        "continuous_usage_stats": False,
        "include_usage": True,
    }
    escaped = b'{"model": "m", "stream\\u005foptions": {"include_usage": false}}'
    rebuilt = ask_for_usage(escaped)
    assert rebuilt is not None and orjson.loads(rebuilt)["stream_options"]["include_usage"]
    assert ask_for_usage(b'{"model": "m", "stream_options": {"include_usage": true}}') is None
    assert ask_for_usage(b'{"model": "m", "stream\\u005foptions": {"include_usage": true}}') is None


USAGE_EVENT = (
    b'data: {"id":"c","object":"chat.completion.chunk","choices":[],'
    b'"usage":{"prompt_tokens":5,"completion_tokens":7,"total_tokens":12}}\n\n'
)
TOKEN = b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"usage"}}]}\n\n'
DONE = b"data: [DONE]\n\n"


def test_the_usage_event_is_dropped_and_every_other_byte_kept() -> None:
    stream = TOKEN + TOKEN.replace(b"\n\n", b"\r\n\r\n") + USAGE_EVENT + DONE
    for size in (1, 3, 7, 64, len(stream)):
        drop = UsageEvents()
        pieces = [drop(stream[i : i + size]) for i in range(0, len(stream), size)]
        pieces.append(drop.flush())
        assert b"".join(pieces) == stream.replace(USAGE_EVENT, b""), size
    # a usage object on a choice chunk (an engine's own choice) is the client's to see
    drop = UsageEvents()
    own = b'data: {"choices":[{"delta":{}}],"usage":{"prompt_tokens":1}}\n\n'
    assert drop(own) == own
    # an unfinished last event is given back at the end, unless it is the usage event
    drop = UsageEvents()
    assert drop(TOKEN + b"data: {") == TOKEN
    assert drop.flush() == b"data: {"
    drop = UsageEvents()
    assert drop(USAGE_EVENT[:-2]) == b"" and drop.flush() == b""


def test_output_is_counted_from_the_text_relayed() -> None:
    text = TextMeter()
    chat = b'data: {"choices":[{"index":0,"delta":{"content":"abcd\\u00e9"}}]}\n\n'  # 6 bytes
    tool = b'data: {"choices":[{"delta":{"tool_calls":[{"function":{"arguments":"{}"}}]}}]}\n\n'
    completion = b'data: {"choices":[{"text":"xy"}]}\n\n'
    anthropic = b'event: content_block_delta\ndata: {"delta":{"type":"text_delta","text":"hi"}}\n\n'
    stream = chat + tool + completion + anthropic + DONE + USAGE_EVENT
    for piece in (stream[:10], stream[10:71], stream[71:]):
        text.feed(piece)
    assert text.text_bytes == 6 + 2 + 2 + 2
    assert text.tokens() == 3  # 12 bytes at OUTPUT_BYTES_PER_TOKEN
    cut = TextMeter()
    cut.feed(chat[:-2])  # a stream cut before the line ended still counts what it carried
    assert cut.tokens() == 2


def test_an_anthropic_stream_cut_before_its_delta_reports_no_output() -> None:
    meter = StreamMeter()
    meter.feed(
        b'event: message_start\ndata: {"type":"message_start","message":'
        b'{"usage":{"input_tokens":9,"output_tokens":1}}}\n\n'
    )
    assert meter.reported() == (9, None)


ROLE = b'data: {"id":"c","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'


async def test_a_stream_cut_before_its_usage_counts_one_token_per_content_event() -> None:
    """An engine asked for usage streams token by token: cut before its report, the stream
    is counted by its content events (the chat role event is not one), its text unread."""
    answer = Answer(200, [], Whole(), first=ROLE + TOKEN)
    answer.expect_usage(anthropic=False, framing=1)
    answer.input_estimate = 11
    assert answer.expects_usage
    await answer.close(Outcome.CLIENT_GONE)
    assert answer.usage_estimated and answer.usage == Usage(11, 1)
    anthropic = (
        b'event: message_start\ndata: {"type":"message_start","message":'
        b'{"usage":{"input_tokens":9,"output_tokens":1}}}\n\n'
        b'event: content_block_delta\ndata: {"type":"content_block_delta",'
        b'"delta":{"type":"text_delta","text":"hello there"}}\n\n'
    )
    cut = Answer(200, [], Whole(), first=anthropic)
    cut.expect_usage(anthropic=True, framing=0)
    await cut.close(Outcome.CLIENT_GONE)
    assert cut.usage == Usage(9, 1)
    # reported usage wins over the count
    whole = Answer(200, [], Whole(), first=ROLE + TOKEN * 3 + USAGE_EVENT + DONE)
    whole.expect_usage(anthropic=False, framing=1)
    await whole.close(Outcome.OK)
    assert not whole.usage_estimated and whole.usage == Usage(5, 7)


async def test_a_stream_not_expected_to_report_is_counted_from_its_text() -> None:
    answer = Answer(200, [], Whole(), first=ROLE + TOKEN)  # "usage": 5 bytes, 2 tokens
    await answer.close(Outcome.CLIENT_GONE)
    assert answer.usage_estimated and answer.usage is not None
    assert answer.usage.output_tokens == 2


def test_the_usage_event_is_found_in_a_chunk_of_many_events() -> None:
    """An engine that answers at once sends the whole stream in one chunk: the usage event
    is cut out of it wherever it is, with compact or spaced JSON."""
    spaced = USAGE_EVENT.replace(b'"choices":[]', b'"choices": []')
    for usage in (USAGE_EVENT, spaced):
        stream = ROLE + TOKEN * 500 + usage + DONE
        drop = UsageEvents()
        assert drop(stream) + drop.flush() == ROLE + TOKEN * 500 + DONE
    # a chunk whose empty choices are not the usage event's is left alone
    empty = b'data: {"id":"c","choices":[]}\n\n'
    drop = UsageEvents()
    assert drop(TOKEN + empty + TOKEN) == TOKEN + empty + TOKEN
    # the event is looked for where engines send it, at the end of a chunk (USAGE_WINDOW):
    # one followed in its chunk by more than that is the client's to see, unharmed
    late = ROLE + USAGE_EVENT + TOKEN * (USAGE_WINDOW // len(TOKEN) + 1) + DONE
    drop = UsageEvents()
    assert drop(late) + drop.flush() == late
    # an event whose start lies beyond the window is kept whole, never cut
    far = b"event: usage\nid: " + b"7" * USAGE_WINDOW + b"\n" + USAGE_EVENT + DONE
    drop = UsageEvents()
    assert drop(far) + drop.flush() == far
    # an unterminated last event of two lines is read as two lines
    tail = USAGE_EVENT[:-2] + b"\n: bye"
    drop = UsageEvents()
    assert drop(tail) == b"" and drop.flush() == b""
    # an event written over two data lines is read whole
    split = USAGE_EVENT.replace(b'"choices":[],', b'"choices":[],\ndata: ')
    drop = UsageEvents()
    assert drop(ROLE + split + DONE) + drop.flush() == ROLE + DONE


def test_a_whole_answer_without_usage_is_counted_from_its_text() -> None:
    chat = b'{"choices": [{"message": {"role": "assistant", "content": "12345678"}}]}'
    assert body_text_bytes(chat) == 8
    completion = b'{"choices": [{"text": "1234"}, {"text": "5678"}]}'  # n = 2
    assert body_text_bytes(completion) == 8
    anthropic = (
        b'{"type": "message", "content": [{"type": "text", "text": "1234"},'
        b' {"type": "tool_use", "input": {"a": 1}}]}'
    )
    assert body_text_bytes(anthropic) == 4 + len(b'{"a":1}')
    assert body_text_bytes(b'{"data": [{"embedding": [0.1]}]}') is None
    assert body_text_bytes(b'{"input_tokens": 12}') is None
    assert body_text_bytes(b"<html>") is None


async def test_the_answer_counts_a_whole_body_without_usage() -> None:
    body = b'{"choices": [{"message": {"content": "' + b"x" * 40 + b'"}}]}'
    answer = Answer(200, [], Whole(), body=body)
    answer.input_estimate = 9
    await answer.close(Outcome.OK)
    assert answer.usage_estimated and answer.usage == Usage(9, 10)
    reported = Answer(
        200, [], Whole(), body=b'{"usage": {"prompt_tokens": 1, "completion_tokens": 2}}'
    )
    await reported.close(Outcome.OK)
    assert not reported.usage_estimated and reported.usage == Usage(1, 2)
    embeddings = Answer(200, [], Whole(), body=b'{"data": []}')
    await embeddings.close(Outcome.OK)
    assert embeddings.usage is None


def test_text_members_are_counted_once_and_decoded() -> None:
    text = TextMeter()
    # arguments that hold JSON with a "content" key of their own: counted once, decoded
    args = b'data: {"choices":[{"delta":{"tool_calls":[{"function":{"arguments":'
    args += b'"{\\"content\\": \\"x\\"}"}}]}}]}\n\n'
    text.feed(args)
    assert text.text_bytes == len(b'{"content": "x"}')
    role = b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n'
    text.feed(role)
    assert text.text_bytes == len(b'{"content": "x"}')


_EVENTS = st.sampled_from(
    [
        ROLE,
        TOKEN,
        TOKEN.replace(b"\n\n", b"\r\n\r\n"),
        USAGE_EVENT,
        USAGE_EVENT.replace(b'"choices":[]', b'"choices": []'),
        USAGE_EVENT.replace(b"\n\n", b"\r\n\r\n"),
        USAGE_EVENT.replace(b'"id":"c"', b'"type":"x"'),  # read another way by the meter
        USAGE_EVENT.replace(b'"id":"c"', b'"id":"message_1"'),
        USAGE_EVENT.replace(b'"choices":[],', b'"choices":[],\ndata: '),  # two data lines
        USAGE_EVENT.replace(b'"prompt_tokens":5,"completion_tokens":7,', b""),  # no counts
        USAGE_EVENT.replace(b"7", b"9"),
        b'data: {"choices":[{"delta":{}}],"usage":{"prompt_tokens":1,"completion_tokens":2}}\n\n',
        b": keep-alive\n\n",
        DONE,
    ]
)


@settings(max_examples=400, deadline=None)
@given(st.lists(_EVENTS, max_size=12), st.data())
def test_the_usage_the_filter_hands_over_is_what_the_meter_would_read(
    events: list[bytes], data: st.DataObject
) -> None:
    """The filter's `found` (given to the answer so its meter need not search again) is,
    whenever set, what the meter reads from the same stream, however it is cut. (The meter
    is fed it whole: chunk by chunk it keeps the last TAIL_CHUNKS only, and misses a usage
    event cut over more chunks than that, which the filter, holding it whole, does not.)"""
    stream = b"".join(events)
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(stream) - 1)), max_size=6)))
    chunks = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
    chunks = [chunk for chunk in chunks if chunk]
    drop, meter = UsageEvents(), StreamMeter()
    meter.feed(stream)
    for chunk in chunks:
        drop(chunk)
    drop.flush()
    if drop.found is not None:
        assert drop.found == meter.reported()
    plain = (USAGE_EVENT, USAGE_EVENT.replace(b'"choices":[]', b'"choices": []'))
    if events and events[-1] in plain:
        assert drop.found == (5, 7)  # the usual stream's last event: handed over


_START = (
    b'event: message_start\ndata: {"type":"message_start","message":'
    b'{"usage":{"input_tokens":500,"output_tokens":1}}}\n\n'
)
_DELTA = (
    b'event: content_block_delta\ndata: {"type":"content_block_delta",'
    b'"delta":{"type":"text_delta","text":"word"}}\n\n'
)
_END = b'event: message_delta\ndata: {"type":"message_delta","usage":{"output_tokens":20}}\n\n'


@pytest.mark.parametrize(
    "opening",
    [
        [b": keepalive\n\n", _START],  # a comment first
        [b'event: ping\ndata: {"type":"ping"}\n\n', _START],  # a ping first
        [_START[:50], _START[50:]],  # the start split across two reads
    ],
)
async def test_an_anthropic_start_after_the_first_chunk_is_still_read(
    opening: list[bytes],
) -> None:
    """Found by a new user (llama.cpp's order): a `message_start` outside the first chunk
    of a long stream was billed zero input tokens."""
    answer = Answer(200, [], Whole(), first=opening[0])
    answer.input_estimate = 77
    meter = answer._meter
    assert meter is not None
    for chunk in [*opening[1:], *[_DELTA] * 40, _END]:
        meter.feed(chunk)
    await answer.close(Outcome.OK)
    assert answer.usage == Usage(500, 20)


async def test_an_anthropic_stream_whose_start_is_lost_counts_the_estimate_not_zero() -> None:
    answer = Answer(200, [], Whole(), first=_DELTA)
    answer.input_estimate = 77
    meter = answer._meter
    assert meter is not None
    for chunk in [_DELTA] * 3000 + [_END]:  # the head has no start; the tail has the end
        meter.feed(chunk)
    await answer.close(Outcome.OK)
    assert answer.usage == Usage(77, 20)
    assert answer.usage_estimated  # so admission's estimator does not learn from itself


def test_a_line_is_never_read_across_the_chunks_dropped_between_head_and_tail() -> None:
    meter = StreamMeter()
    meter.feed(b'data: {"choices":[],"usage":{"prompt_tokens":1')  # cut: no line end
    for _ in range(2000):
        meter.feed(b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n')
    meter.feed(b',"completion_tokens":5}}\n\ndata: [DONE]\n\n')
    assert meter.reported() is None
