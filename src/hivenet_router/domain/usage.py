"""Token usage read from answers, for accounting: the one meter every sink reads.

A buffered answer is parsed only when it mentions usage. A stream keeps references to its
first chunk and last few chunks (no copies) and parses them once, at the end: OpenAI streams
put usage in the last data event when `stream_options.include_usage` is set (the router sets
it on the way to engines that support it, `ask_for_usage`, and drops that event from the
client's stream when the client did not ask, `UsageEvents`); Anthropic streams put input
tokens in `message_start` and output tokens in `message_delta`.

Only when a stream reports no output count is output counted from what was relayed. A
stream whose engine was asked for usage (or that reports it by its format) and was cut
before the report counts one output token per content event (`StreamMeter.count_events`):
engines that stream token by token send one event a token. Any other stream (an engine
without include_usage) counts its text (`TextMeter`): the UTF-8 bytes of the generated
text (content, reasoning, tool-call arguments) divided by OUTPUT_BYTES_PER_TOKEN, rounded
up. Only these streams pay for a scan of every chunk. docs/admission.md gives the error.
"""

from __future__ import annotations

import math
import re
from collections import deque
from typing import Any, Final

import msgspec
import orjson

from hivenet_router.domain.request import RequestFacts, Usage

TAIL_CHUNKS = 4
# The start of a stream kept whole: Anthropic's `message_start` (its input count) may follow
# a ping or a comment, or be split across reads; it is never this far in.
HEAD_BYTES = 8192

# Engines whose OpenAI-compatible servers honour `stream_options.include_usage` (the
# simulator registers as vllm). Other engines get the client's body unchanged.
USAGE_ENGINES: Final = frozenset({"vllm", "sglang", "llamacpp"})
USAGE_ROUTES: Final = frozenset({"/v1/chat/completions", "/v1/completions"})
# Bytes of generated text per output token when no usage was reported (docs/admission.md).
OUTPUT_BYTES_PER_TOKEN: Final = 4.0
# The input counted for an answer without usage: admission's starting estimate.
INPUT_TOKENS_PER_BYTE: Final = 1 / 3.2
MESSAGE_OVERHEAD: Final = 4  # tokens of role and framing per message
_CARRY_MAX = 1 << 20
_BODY_TEXT_MAX = 4 << 20  # a partial line kept across chunks past this is dropped uncounted


# A count past this is no count. JSON allows any integer; orjson (streams) reads one past
# 2**64 - 1 as a float, which counts as zero, and msgspec (whole answers) as an int: the
# bound makes both readers count such an answer alike.
_MAX_COUNT = 2**64 - 1


def input_estimate(facts: RequestFacts) -> int:
    """Input tokens counted for an answer that reported none."""
    return math.ceil(facts.text_bytes * INPUT_TOKENS_PER_BYTE) + MESSAGE_OVERHEAD * facts.messages


def _int(value: Any) -> int:
    ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _MAX_COUNT
    return value if ok else 0


def _from_usage(usage: Any) -> tuple[int, int] | None:
    if not isinstance(usage, dict):
        return None
    if "prompt_tokens" in usage:
        prompt = usage["prompt_tokens"]  # a null count is the count given: no fallback
    else:
        prompt = usage.get("input_tokens")
        if prompt is not None and (_CACHE_READ in usage or _CACHE_WRITE in usage):
            # Anthropic's input_tokens leaves out what the prompt cache read or wrote,
            # which OpenAI's prompt_tokens includes: a resent conversation counted only
            # its new tokens (found by a new user on llama.cpp).
            prompt = _int(prompt) + _int(usage.get(_CACHE_READ)) + _int(usage.get(_CACHE_WRITE))
    completion = usage.get("completion_tokens", usage.get("output_tokens"))
    if prompt is None and completion is None:
        # A rerank's usage in vLLM's and Jina's shape counts its input as total_tokens.
        total = usage.get("total_tokens")
        return None if total is None else (_int(total), 0)
    return _int(prompt), _int(completion)


_CACHE_READ = "cache_read_input_tokens"
_CACHE_WRITE = "cache_creation_input_tokens"


class _Whole(msgspec.Struct):
    # Kept raw and read in a second step, so that of repeated `usage` members the last
    # counts whatever the earlier ones hold, as with a reader that builds the whole answer.
    usage: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET


# Only the top-level `usage` member becomes Python objects: the rest of the answer (its
# text, its choices) is checked and skipped, not built and freed again. For a 1 KB chat
# answer, 1.7 to 1.9 us against 2.8 us for the orjson version, which built the whole
# answer (a loop of 200,000). The member itself goes through `_from_usage`, as a stream's.
_WHOLE = msgspec.json.Decoder(_Whole)
_VALUE = msgspec.json.Decoder()


def from_body(body: bytes) -> Usage | None:
    """The usage a whole answer reports in its top-level `usage` object (OpenAI's or
    Anthropic's names), or None: no such object, neither count in it, or not JSON. Text
    elsewhere in the answer is skipped unread, so a stray invalid byte in it does not cost
    the answer its accounting."""
    if b'"usage"' not in body:
        return None
    try:
        raw = _WHOLE.decode(body).usage
        if raw is msgspec.UNSET:
            return None
        found = _from_usage(_VALUE.decode(raw))
    except msgspec.DecodeError:  # not JSON, or not an object
        return None
    except RecursionError:  # nested past what the decoder follows (orjson stopped at 1,024)
        return None
    return Usage(*found) if found else None


class StreamMeter:
    """Keeps references to a stream's first chunks (up to HEAD_BYTES) and last chunks
    (parsed once, at the end) and, once `count_events` was called, counts its content
    events: one `count` per chunk."""

    __slots__ = ("_fed", "_first", "_framing", "_head", "_marker", "_room", "_tail", "events")

    def __init__(self) -> None:
        self._first: bytes | None = None
        self._head: list[bytes] = []  # the chunks after the first, while there is room
        self._room = HEAD_BYTES
        self._tail: deque[bytes] = deque(maxlen=TAIL_CHUNKS)
        self._fed = 0  # chunks past the head, the tail's and the dropped
        self._marker = b""
        self._framing = 0
        self.events = 0

    def feed(self, chunk: bytes) -> None:
        if self._first is None:
            self._first = chunk
            self._room -= len(chunk)
        elif self._room > 0:
            self._head.append(chunk)
            self._room -= len(chunk)
        else:
            self._tail.append(chunk)
            self._fed += 1
        if self._marker:
            self.events += chunk.count(self._marker)

    def count_events(self, anthropic: bool, framing: int) -> None:
        """Count content events from here on (the first chunk included): Anthropic
        `content_block_delta` events, or OpenAI data events less `framing` (the role event
        that opens a chat stream)."""
        self._marker = b'"content_block_delta"' if anthropic else b"data:"
        self._framing = framing
        self.events = self._first.count(self._marker) if self._first is not None else 0

    @property
    def counts_events(self) -> bool:
        return bool(self._marker)

    @property
    def counting(self) -> tuple[bool, int]:
        return self._marker == b'"content_block_delta"', self._framing

    def event_tokens(self) -> int:
        """Output tokens for a stream cut before its usage report: one per content event."""
        return max(0, self.events - self._framing)

    def result(self) -> Usage | None:
        found = self.reported()
        if found is None:
            return None
        return Usage(found[0] or 0, found[1] or 0)

    def reported(self) -> tuple[int | None, int | None] | None:
        """Input and output tokens the stream reported, or None for no report; the output
        is None when only the start was reported (an Anthropic stream cut before its
        `message_delta`), the input None when only the end was (its `message_start` not
        found: the caller counts the estimate, never zero)."""
        if self._first is None:
            return None
        head = self._first + b"".join(self._head) if self._head else self._first
        # Chunks dropped between the head and the tail: a blank line between them, so that
        # no line is read across the gap as one.
        gap = b"\n\n" if self._fed > len(self._tail) else b""
        text = head + gap + b"".join(self._tail) if self._tail else head
        # An OpenAI stream reports last: its last usage line says it all, found from the end
        # (a stream's text is not searched twice). Anthropic's start and delta are read below.
        last = text.rfind(b'"usage"')
        if last < 0:
            return None
        line = _line_at(text, last)
        if line.startswith(b"data:") and b'"message_' not in line:
            try:
                event = orjson.loads(line[5:])
            except orjson.JSONDecodeError:
                event = None
            if isinstance(event, dict) and "type" not in event:
                found = _from_usage(event.get("usage"))
                if found is not None:
                    return found
        prompt: int | None = None
        completion: int | None = None
        seen = False
        for line in _lines_with(text, b'"usage"'):
            if not line.startswith(b"data:"):
                continue
            try:
                event = orjson.loads(line[5:])
            except orjson.JSONDecodeError:
                continue  # a line cut by the tail window
            if not isinstance(event, dict):
                continue
            message = event.get("message")
            usage = event.get("usage")
            if usage is None and isinstance(message, dict):
                usage = message.get("usage")
            found = _from_usage(usage)
            if found is None:
                continue
            seen = True
            if event.get("type") == "message_start":
                prompt = found[0]
            elif event.get("type") == "message_delta":
                completion = found[1]
                if not prompt and _has_input(usage):
                    prompt = found[0]
            else:
                prompt, completion = found
        return (prompt, completion) if seen else None


def _has_input(usage: Any) -> bool:
    """Does this usage object count input (a `message_delta` may count output alone)?"""
    return isinstance(usage, dict) and any(
        usage.get(name) is not None for name in ("input_tokens", "prompt_tokens")
    )


def _line_at(text: bytes, at: int) -> bytes:
    """The line of `text` that holds position `at`, without its line ending."""
    start = text.rfind(b"\n", 0, at) + 1
    end = text.find(b"\n", at)
    return text[start : len(text) if end < 0 else end].rstrip(b"\r")


def _lines_with(text: bytes, needle: bytes) -> list[bytes]:
    """The lines of `text` that hold `needle`, found by search rather than by splitting (a
    stream read in one chunk has a hundred lines and one or two with usage)."""
    lines: list[bytes] = []
    at = text.find(needle)
    while at >= 0:
        lines.append(_line_at(text, at))
        end = text.find(b"\n", at)
        at = text.find(needle, end) if end >= 0 else -1
    return lines


def _text_bytes(value: Any) -> int:
    return len(value.encode()) if isinstance(value, str) else 0


def _event_text(event: Any) -> int:
    """Bytes of generated text in one stream event: OpenAI chat deltas (content, reasoning,
    tool-call arguments), completions text, Anthropic content deltas."""
    if not isinstance(event, dict):
        return 0
    total = 0
    choices = event.get("choices")
    if isinstance(choices, list):
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            total += _text_bytes(choice.get("text"))
            delta = choice.get("delta")
            if isinstance(delta, dict):
                total += _text_bytes(delta.get("content"))
                total += _text_bytes(delta.get("reasoning_content"))
                total += _text_bytes(delta.get("reasoning"))
                calls = delta.get("tool_calls")
                if isinstance(calls, list):
                    for call in calls:
                        function = call.get("function") if isinstance(call, dict) else None
                        if isinstance(function, dict):
                            total += _text_bytes(function.get("arguments"))
        return total
    delta = event.get("delta")
    if isinstance(delta, dict):  # Anthropic content_block_delta
        for name in ("text", "partial_json", "thinking"):
            total += _text_bytes(delta.get(name))
    return total


def body_text_bytes(body: bytes) -> int | None:
    """Bytes of generated text in a whole answer that reported no usage: OpenAI chat
    (`message` content, reasoning, tool-call arguments) and completions (`text`), Anthropic
    `content` blocks; None when the answer has neither (embeddings, count_tokens), or is
    too large to parse on the event loop (no text answer comes near the bound)."""
    if len(body) > _BODY_TEXT_MAX or (b'"choices"' not in body and b'"content"' not in body):
        return None
    try:
        decoded = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(decoded, dict):
        return None
    choices = decoded.get("choices")
    if isinstance(choices, list):
        # A whole choice reads as a stream's delta does.
        as_deltas = [
            {**c, "delta": c.get("message")} if isinstance(c, dict) else c for c in choices
        ]
        return _event_text({"choices": as_deltas})
    content = decoded.get("content")
    if decoded.get("type") == "message" and isinstance(content, list):
        total = 0
        for block in content:
            if not isinstance(block, dict):
                continue
            total += _text_bytes(block.get("text")) + _text_bytes(block.get("thinking"))
            if block.get("type") == "tool_use":
                total += len(orjson.dumps(block.get("input")))
        return total
    return None


# The string members of stream events that carry generated text (OpenAI chat deltas and
# tool-call arguments, completions text, Anthropic content deltas).
_TEXT_MEMBER = re.compile(
    rb'"(?:content|text|arguments|reasoning_content|reasoning|partial_json|thinking)"'
    rb':\s*"((?:[^"\\]|\\.)*)"'
)


def _decoded_length(raw: bytes) -> int:
    """UTF-8 bytes of a JSON string's escaped contents (as sent when they do not decode)."""
    try:
        return len(orjson.loads(b'"' + raw + b'"').encode())
    except orjson.JSONDecodeError:
        return len(raw)


class TextMeter:
    """The generated text a stream carried, in UTF-8 bytes, for an answer whose usage is
    unknown: complete lines are scanned once for the members that carry text. A line split
    across chunks is carried over (up to _CARRY_MAX bytes)."""

    __slots__ = ("_carry", "text_bytes")

    def __init__(self) -> None:
        self._carry = b""
        self.text_bytes = 0

    def feed(self, chunk: bytes) -> None:
        if self._carry:
            chunk = self._carry + chunk
        cut = chunk.rfind(b"\n") + 1
        carry = chunk[cut:]
        self._carry = carry if len(carry) <= _CARRY_MAX else b""
        if cut:
            self._count(chunk[:cut])

    def _count(self, lines: bytes) -> None:
        # One C-level scan of the chunk, not a JSON parse of each event (half the time):
        # inside a JSON string every quote is escaped, so these keys match only as keys.
        for raw in _TEXT_MEMBER.findall(lines):
            self.text_bytes += _decoded_length(raw) if b"\\" in raw else len(raw)

    def tokens(self) -> int:
        """Output tokens estimated from the text so far (an unfinished last line included)."""
        if self._carry:
            self._count(self._carry)
            self._carry = b""
        return math.ceil(self.text_bytes / OUTPUT_BYTES_PER_TOKEN)


def wants_usage(body: bytes) -> bool:
    """Does this request body ask for `stream_options.include_usage` itself?"""
    if b"stream_options" not in body and b"\\u" not in body:
        return False
    try:
        decoded = orjson.loads(body)
    except orjson.JSONDecodeError:
        return False
    options = decoded.get("stream_options") if isinstance(decoded, dict) else None
    return isinstance(options, dict) and options.get("include_usage") is True


def ask_for_usage(body: bytes) -> bytes | None:
    """The request body with `stream_options.include_usage` set, for an engine that honours
    it; None when the client asked for usage itself (or the body is not a JSON object). The
    common body, without stream_options, gets the member appended before its closing brace;
    the rest are rebuilt."""
    if b"stream_options" not in body and b"\\u" not in body:
        end = body.rfind(b"}")
        if end > 0 and not body[end + 1 :].strip():
            return body[:end] + b',"stream_options":{"include_usage":true}' + body[end:]
        return None
    try:
        decoded = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(decoded, dict):
        return None
    options = decoded.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage") is True:
        return None
    kept = options if isinstance(options, dict) else {}
    decoded["stream_options"] = {**kept, "include_usage": True}
    try:
        return orjson.dumps(decoded)
    except TypeError:  # an integer past 64 bits: leave the body alone
        return None


def _event_end(data: bytes, start: int) -> int:
    """Where the SSE event starting at `start` ends (after its blank line), or -1."""
    lf = data.find(b"\n\n", start)
    # Only a CRLF blank line before the LF one can end the event first.
    crlf = data.find(b"\n\r\n", start, lf + 2 if lf >= 0 else len(data))
    if lf < 0:
        return crlf + 3 if crlf >= 0 else -1
    if crlf < 0 or lf < crlf:
        return lf + 2
    return crlf + 3


def _usage_event(event: bytes) -> tuple[bool, dict[str, Any]] | None:
    """For an OpenAI event with no choices and a usage object (the one include_usage adds):
    whether `StreamMeter.reported` would read it the same way as its last line with usage
    (one `data:` line, with no `type` member and no `"message_` in it), and the event; None
    for any other event."""
    if b'"usage"' not in event:
        return None
    line = event.rstrip(b"\r\n")
    one_line = line.startswith(b"data:") and b"\n" not in line and b"\r" not in line
    if one_line:
        data = line[5:]  # as engines send it
    else:
        data = b"".join(line[5:] for line in event.splitlines() if line.startswith(b"data:"))
    try:
        decoded = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    if (
        isinstance(decoded, dict)
        and decoded.get("choices") == []
        and isinstance(decoded.get("usage"), dict)
    ):
        plain = one_line and b'"message_' not in data and "type" not in decoded
        return plain, decoded
    return None


class UsageEvents:
    """Drops the usage-only events from the stream sent to a client that did not ask for
    them (the router asks engines on its behalf); every other byte passes unchanged, in
    order. An event split across chunks is held until it is whole (SSE clients act only on
    whole events).

    `found` is the usage of the last event it dropped, read as `StreamMeter.reported` would
    read the stream (its last line with usage), so the meter need not find and parse that
    event again; None when none was dropped, when that reading could differ, or when usage
    was mentioned after it."""

    __slots__ = ("_held", "found")

    def __init__(self) -> None:
        self._held = b""
        self.found: tuple[int, int | None] | None = None

    def __call__(self, chunk: bytes) -> bytes:
        if self._held:
            chunk, self._held = self._held + chunk, b""
        if chunk.endswith(b"\n\n"):  # the usual chunk: whole events
            ready = chunk
        else:
            lf, crlf = chunk.rfind(b"\n\n"), chunk.rfind(b"\n\r\n")
            cut = max(lf + 2 if lf >= 0 else 0, crlf + 3 if crlf >= 0 else 0)
            ready, self._held = chunk[:cut], chunk[cut:]
        if self.found is not None and b'"usage"' in ready:
            self.found = None  # a later line with usage: the meter reads that one
        # The usage event comes last, before `[DONE]`: only the end of a chunk is searched,
        # so the usual chunks (and a whole answer sent in one) cost one short search.
        low = max(0, len(ready) - USAGE_WINDOW)
        if ready.find(b'"usage"', low) < 0:  # in JSON text a quote is escaped: a member
            return ready
        dropped: list[tuple[int, tuple[bool, dict[str, Any]]]] = []
        kept = _drop_usage(ready, low, dropped)
        if dropped:
            self._dropped(ready, *dropped[-1])
        return kept

    def flush(self) -> bytes:
        """What is held at the end of the stream (an event without its blank line)."""
        held, self._held = self._held, b""
        found = _usage_event(held)
        if found is None:
            if self.found is not None and b'"usage"' in held:
                self.found = None
            return held
        self._dropped(held, len(held), found)
        return b""

    def _dropped(self, data: bytes, end: int, event: tuple[bool, dict[str, Any]]) -> None:
        plain, decoded = event
        self.found = _from_usage(decoded["usage"]) if plain else None
        if data.find(b'"usage"', end) >= 0:
            self.found = None


# The empty choices of the event include_usage adds. Inside a JSON string every quote is
# escaped, so these bytes occur only as the member itself (compact or with one space, as
# the engines and json.dumps write it); an event written otherwise reaches the client.
_EMPTY_CHOICES = (b'"choices":[]', b'"choices": []')
# How much of the end of a chunk is searched for the usage event: the event (a few hundred
# bytes), `[DONE]` after it, and room to spare. An engine that sent the usage event with
# more than this after it in the same chunk would have it reach the client.
USAGE_WINDOW = 2048


def _event_start(data: bytes, at: int, floor: int) -> int:
    """Where the SSE event holding position `at` starts (after the previous blank line)."""
    lf = data.rfind(b"\n\n", floor, at)
    # Only a CRLF blank line after the LF one can be the nearer.
    crlf = data.rfind(b"\n\r\n", lf if lf >= 0 else floor, at)
    return max(lf + 2 if lf >= 0 else floor, crlf + 3 if crlf >= 0 else floor)


def _drop_usage(
    data: bytes,
    low: int = 0,
    dropped: list[tuple[int, tuple[bool, dict[str, Any]]]] | None = None,
) -> bytes:
    """`data` without its usage-only events whose empty choices lie at or after `low`, each
    dropped one added to `dropped` with where it ended. Only the events holding empty
    choices are looked at (one a stream), so a chunk of many events costs a few searches,
    not a walk."""
    kept: list[bytes] = []
    start = 0  # what is not yet kept
    search = low
    compact, spaced = _EMPTY_CHOICES
    while True:
        at = data.find(compact, search)
        # The other spelling, only where it would come first.
        other = data.find(spaced, search, at + len(spaced) if at >= 0 else len(data))
        if other >= 0 and (at < 0 or other < at):
            at = other
        elif at < 0:
            break
        # The event begins shortly before its choices: the backward search is bounded, and
        # an event whose start is not found within it is kept whole, never cut.
        floor = max(start, at - USAGE_WINDOW)
        begin = _event_start(data, at, floor)
        end = _event_end(data, at)
        if end < 0:
            end = len(data)
        found = _usage_event(data[begin:end]) if begin > floor or floor == start else None
        if found is not None:
            kept.append(data[start:begin])
            if dropped is not None:
                dropped.append((end, found))
        else:
            kept.append(data[start:end])
        start = search = end
    if not kept:
        return data
    kept.append(data[start:])
    return b"".join(kept)


def stream_input_tokens(first: bytes) -> int | None:
    """Input tokens announced at the start of a stream (Anthropic `message_start`). Only the
    first event is read, which is where that event comes: an OpenAI stream's first chunk
    (at times its whole answer) is not searched, and a stream that opens with another
    event has its input counted at its end, from its usage."""
    end = _event_end(first, 0)
    head = first if end < 0 else first[:end]
    if b'"input_tokens"' not in head:
        return None
    for line in head.split(b"\n"):
        if line.startswith(b"data:") and b"message_start" in line:
            try:
                event = orjson.loads(line[5:])
            except orjson.JSONDecodeError:
                return None
            message = event.get("message") if isinstance(event, dict) else None
            usage = message.get("usage") if isinstance(message, dict) else None
            found = _from_usage(usage)
            return found[0] if found else None
    return None
