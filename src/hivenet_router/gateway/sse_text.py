"""The text a model generated, pulled out of its answer: stream chunks (server-sent events)
or a whole body, in the OpenAI shapes (chat and completions) and the Anthropic one.

What counts as generated text: chat `delta.content`, the reasoning deltas some engines send
(`reasoning_content`, `reasoning`), completions `text`, Anthropic `text_delta` and
`thinking_delta`. Tool-call arguments do not: JSON arguments repeat keys by nature.

Chunks are cut wherever the network cut them: an event may span chunks, a chunk may hold
many events. `SseText` keeps the unfinished last line between chunks and parses only
`data:` lines that can carry text; anything it cannot read is skipped, never raised. It
also notes the answer's terminal event (OpenAI `data: [DONE]`, Anthropic `message_stop`):
once a chunk carrying it has gone out, the client holds a complete answer.
"""

from __future__ import annotations

from typing import Any, Final, Protocol

import orjson

# A line longer than this without its end is no event worth reading: dropped, so a broken
# stream cannot grow the buffer without bound.
MAX_LINE: Final = 1 << 20
_HINTS: Final = (b'"content"', b'"text"', b'"reasoning', b'"thinking"')
_DELTA_FIELDS: Final = ("content", "reasoning_content", "reasoning")
# SSE fields other than data and event, and comments: no text, no fault.
_OTHER_FIELDS: Final = (b":", b"id:", b"id\r", b"retry:")


class EventSink(Protocol):
    """Who else reads every event (the syntax judge): offered each `data:` payload first
    unparsed (`quick`: the text it carries when the sink could read it so, else None), then
    handed it parsed, and told of each line that is no SSE field or payload that is no JSON."""

    def quick(self, payload: bytes) -> str | None: ...

    def event(self, event: Any, payload: bytes) -> None: ...

    def bad(self, why: str) -> None: ...


class SseText:
    """Feed it a stream's chunks in order; each call returns the text pieces (one per
    event) the chunk completed. With a `sink`, every line is read and every `data:` payload
    parsed (once) and handed to it as well."""

    __slots__ = ("_rest", "_sink", "_skip", "done")

    def __init__(self, sink: EventSink | None = None) -> None:
        self._rest = b""
        self._skip = False  # inside an overlong line: drop until its end
        self._sink = sink
        self.done = False  # the terminal event has been fed: no text follows

    def feed(self, chunk: bytes) -> list[str]:
        end = chunk.rfind(b"\n")
        if end < 0:
            self._keep(chunk)
            return []
        data = self._rest + chunk[:end] if self._rest else chunk[:end]
        if self._skip:
            cut = data.find(b"\n")
            data = data[cut + 1 :] if cut >= 0 else b""
            self._skip = False
        self._rest = b""
        self._keep(chunk[end + 1 :])
        pieces: list[str] = []
        sink = self._sink
        if sink is not None:
            judge, quick = sink.event, sink.quick
            for line in data.split(b"\n"):
                if line[:5] == b"data:":
                    payload = line[5:]
                    piece = quick(payload)
                    if piece is not None:  # the judge read it without a parse
                        if piece:
                            pieces.append(piece)
                        continue
                    try:
                        event = orjson.loads(payload)
                    except orjson.JSONDecodeError:
                        self._no_json(payload, sink)
                        continue
                    judge(event, payload)
                    if type(event) is dict:
                        choices = event.get("choices")
                        if type(choices) is list:
                            _choices_text(choices, pieces)
                        else:
                            _parsed_text(event, pieces)
                        if event.get("type") == "message_stop":
                            self.done = True
                elif line:
                    self._other(line, sink)
            return pieces
        for line in data.split(b"\n"):
            if line.startswith(b"data:"):
                if any(hint in line for hint in _HINTS):
                    _event_text(line[5:], pieces)
                elif _terminal(line[5:]):
                    self.done = True
            elif line.startswith(b"event:") and line[6:].strip() == b"message_stop":
                self.done = True
        return pieces

    def _no_json(self, payload: bytes, sink: EventSink) -> None:
        if payload.strip() == b"[DONE]":
            self.done = True
        else:
            sink.bad("a data line that is no JSON")

    def _other(self, line: bytes, sink: EventSink) -> None:
        """A line other than `data:`, read when a sink judges them all."""
        if line.startswith(b"event:"):
            if line[6:].strip() == b"message_stop":
                self.done = True
        elif line.strip() and not line.startswith(_OTHER_FIELDS):
            sink.bad("a line that is no SSE field")

    def _keep(self, tail: bytes) -> None:
        if self._skip or not tail:
            return
        if len(self._rest) + len(tail) > MAX_LINE:
            self._rest, self._skip = b"", True
        else:
            self._rest += tail


def _terminal(payload: bytes) -> bool:
    """Is this `data:` payload the end of an answer: `[DONE]`, or an Anthropic message_stop
    sent without its `event:` line?"""
    payload = payload.strip()
    if payload == b"[DONE]":
        return True
    if b'"message_stop"' not in payload:
        return False
    try:
        event = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return False
    return isinstance(event, dict) and event.get("type") == "message_stop"


def _event_text(payload: bytes, out: list[str]) -> None:
    try:
        event = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return
    if isinstance(event, dict):
        _parsed_text(event, out)


def _parsed_text(event: dict[str, Any], out: list[str]) -> None:
    choices = event.get("choices")
    if isinstance(choices, list):
        for choice in choices:
            if isinstance(choice, dict):
                _choice_text(choice, "delta", out)
    elif event.get("type") == "content_block_delta":
        _block_text(event.get("delta"), out)


def _choices_text(choices: list[Any], out: list[str]) -> None:
    """The text of a chat or completions event's choices."""
    for choice in choices:
        if type(choice) is not dict:
            continue
        delta = choice.get("delta")
        if type(delta) is dict and len(delta) == 1 and "tool_calls" in delta:
            continue  # a piece of a tool call, the common event of one: no text in it
        _choice_text(choice, "delta", out)


def _choice_text(choice: dict[str, Any], key: str, out: list[str]) -> None:
    """An OpenAI choice: its `delta` (chat stream) or `message` (chat body), else its
    `text` (completions)."""
    part = choice.get(key)
    if isinstance(part, dict):
        for field in _DELTA_FIELDS:
            text = part.get(field)
            if isinstance(text, str) and text:
                out.append(text)
        return
    text = choice.get("text")
    if isinstance(text, str) and text:
        out.append(text)


def _block_text(block: Any, out: list[str]) -> None:
    """An Anthropic text or thinking block, or such a block's delta."""
    if not isinstance(block, dict):
        return
    for field in ("text", "thinking"):
        text = block.get(field)
        if isinstance(text, str) and text:
            out.append(text)
            return


def body_text(body: bytes) -> str:
    """The generated text of a whole answer's body ("" when it has none, or is no JSON)."""
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError:
        return ""
    return value_text(value)


def value_text(value: Any) -> str:
    """The generated text of a whole answer's parsed body."""
    if not isinstance(value, dict):
        return ""
    out: list[str] = []
    choices = value.get("choices")
    content = value.get("content")
    if isinstance(choices, list):
        for choice in choices:
            if isinstance(choice, dict):
                _choice_text(choice, "message", out)
    elif isinstance(content, list):
        for block in content:
            _block_text(block, out)
    return "".join(out)
