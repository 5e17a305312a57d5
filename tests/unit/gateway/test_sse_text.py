"""Generated text out of stream chunks and whole bodies, in the OpenAI and Anthropic shapes,
however the network cut the events."""

from __future__ import annotations

import orjson

from hivenet_router.gateway.sse_text import MAX_LINE, SseText, body_text


def chat(text: str) -> bytes:
    delta = {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}
    return b"data: " + orjson.dumps(delta) + b"\n\n"


def anthropic(text: str) -> bytes:
    event = {
        "type": "content_block_delta",
        "index": 0,
        "delta": {"type": "text_delta", "text": text},
    }
    return b"event: content_block_delta\ndata: " + orjson.dumps(event) + b"\n\n"


def feed_all(chunks: list[bytes]) -> list[str]:
    parser = SseText()
    out: list[str] = []
    for chunk in chunks:
        out.extend(parser.feed(chunk))
    return out


def test_one_event_per_chunk() -> None:
    assert feed_all([chat(" hello"), chat(" world")]) == [" hello", " world"]


def test_several_events_in_one_chunk() -> None:
    assert feed_all([chat("a") + chat("b") + chat("c")]) == ["a", "b", "c"]


def test_events_split_anywhere_give_the_same_pieces() -> None:
    stream = b"".join(chat(word) for word in (" the", " router", ' "keeps"', " \u00e9t\u00e9"))
    expected = [" the", " router", ' "keeps"', " \u00e9t\u00e9"]
    for size in (1, 2, 3, 7, 50):
        chunks = [stream[i : i + size] for i in range(0, len(stream), size)]
        assert feed_all(chunks) == expected, size


def test_crlf_lines() -> None:
    assert feed_all([chat("x").replace(b"\n", b"\r\n")]) == ["x"]


def test_anthropic_text_and_thinking_deltas() -> None:
    start = (
        b'event: message_start\ndata: {"type":"message_start","message":{"content":[],'
        b'"usage":{"input_tokens":5,"output_tokens":1}}}\n\n'
    )
    thinking = (
        b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
        b'"delta":{"type":"thinking_delta","thinking":"hmm"}}\n\n'
    )
    tool = (
        b'event: content_block_delta\ndata: {"type":"content_block_delta","index":1,'
        b'"delta":{"type":"input_json_delta","partial_json":"{\\"text\\": 1"}}\n\n'
    )
    assert feed_all([start + thinking, anthropic(" hi"), tool]) == ["hmm", " hi"]


def test_completions_and_reasoning_deltas() -> None:
    completion = b'data: {"choices":[{"index":0,"text":" once","finish_reason":null}]}\n\n'
    reasoning = b'data: {"choices":[{"index":0,"delta":{"reasoning_content":"think"}}]}\n\n'
    assert feed_all([completion, reasoning]) == [" once", "think"]


def test_what_is_not_text_is_skipped() -> None:
    chunks = [
        b": keep-alive comment\n\n",
        b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n',
        b'data: {"choices":[{"delta":{"tool_calls":[{"function":{"arguments":"x"}}]}}]}\n\n',
        b'data: {"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":2}}\n\n',
        b"data: [DONE]\n\n",
        b'data: {"content": not json\n\n',
        b'data: ["content"]\n\n',
        b'data: {"choices":[{"delta":{"content":7}}],"text":1}\n\n',
        b'data: {"type":"content_block_delta","delta":"text"}\n\n',
        chat("kept"),
    ]
    assert feed_all(chunks) == ["kept"]


def test_an_overlong_line_is_dropped_and_the_stream_goes_on() -> None:
    parser = SseText()
    assert parser.feed(b'data: {"content":"' + b"x" * (MAX_LINE // 2)) == []
    assert parser.feed(b"y" * MAX_LINE) == []
    assert parser.feed(b'z"}\n\n' + chat("after")) == ["after"]


def test_whole_bodies() -> None:
    openai_chat = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi."}}]}
    completion = {"choices": [{"index": 0, "text": "Once."}]}
    claude = {
        "type": "message",
        "content": [
            {"type": "thinking", "thinking": "a "},
            {"type": "text", "text": "b"},
            {"type": "tool_use", "name": "f", "input": {"text": "no"}},
        ],
    }
    assert body_text(orjson.dumps(openai_chat)) == "Hi."
    assert body_text(orjson.dumps(completion)) == "Once."
    assert body_text(orjson.dumps(claude)) == "a b"
    assert body_text(b"not json") == body_text(b"[1]") == body_text(b'{"data": []}') == ""


def test_the_terminal_event_is_noted_however_it_is_cut() -> None:
    stream = chat(" last") + b'data: {"choices":[],"usage":{"prompt_tokens":1}}\n\ndata: [DONE]\n\n'
    line_end = stream.rindex(b"[DONE]") + len(b"[DONE]")  # where its line ends
    for size in (1, 5, 64, len(stream)):
        parser = SseText()
        for i in range(0, len(stream), size):
            parser.feed(stream[i : i + size])
            assert parser.done == (i + size > line_end), (size, i)  # once its line is whole
    crlf = SseText()
    crlf.feed(b"data: [DONE]\r\n\r\n")
    assert crlf.done


def test_anthropic_message_stop_is_terminal() -> None:
    with_event = SseText()
    with_event.feed(anthropic(" a") + b'event: message_stop\ndata: {"type":"message_stop"}\n\n')
    assert with_event.done
    bare = SseText()
    bare.feed(b'data: {"type":"message_stop"}\n\n')
    assert bare.done


def test_text_that_mentions_the_end_is_no_end() -> None:
    parser = SseText()
    pieces = parser.feed(
        chat("data: [DONE]") + anthropic('{"type":"message_stop"}') + b"data: [DONE] soon\n\n"
    )
    assert pieces == ["data: [DONE]", '{"type":"message_stop"}'] and not parser.done
    unfinished = SseText()
    unfinished.feed(b"data: [DONE]")  # the line is not whole yet
    assert not unfinished.done
