from __future__ import annotations

from hivenet_router.domain.usage import StreamMeter, from_body, stream_input_tokens


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
