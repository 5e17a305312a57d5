"""The syntax judge's shortcut: a stream's events that differ from the last one read only in
the piece of text or of tool-call arguments they carry, read without parsing them.

An engine streams one event per token, and within one answer those events are the same
bytes but for the piece: the same envelope (id, model, created), the same choice, the same
call. Once the judge has parsed such an event and found it the plain case (one choice under
way, one piece of a document it judges), it makes a `Template` of it: the bytes before the
piece's string and the bytes after it, taken from the event written again by `orjson` with
a marker in place of the piece, and kept only when that writing is the event's own bytes
(so an engine that writes its JSON another way simply gets no shortcut).

A later payload fits the template when it starts with the same head, ends with the same
tail and holds between them a well-formed JSON string body (RFC 8259: no bare quote or
control character, only valid escapes, valid UTF-8; orjson checks it as it reads the
string). Such a payload is then valid JSON of exactly the template's shape with another
string in that one place, so the judge needs only that string: the checks it would have
made on the parsed event (the `events` check, the shape, which document the piece belongs
to) come out the same. Anything else (another shape, a finish reason, a payload that does
not decode) goes the general way, parsed.

Pure: no I/O.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

import orjson

if TYPE_CHECKING:
    from hivenet_router.gateway.syntax import Doc

# Put where the piece was, to find where it is written; private-use characters no engine
# writes, and checked to occur once.
MARK: Final = "\ue000hivenet-piece\ue001"
_MARK_BYTES: Final = orjson.dumps(MARK)[1:-1]
# Fields whose text the loop detector reads (sse_text): of a chat delta, the piece's first;
# of an Anthropic block delta, the same.
_CHAT_TEXT: Final = ("content", "reasoning_content", "reasoning")
_BLOCK_TEXT: Final = ("text", "thinking")


class Template:
    """The bytes around one event's piece; `text`: the piece is generated text (the loop
    detector reads it too), else a tool call's arguments."""

    __slots__ = ("doc", "head", "tail", "text")

    def __init__(self, head: bytes, tail: bytes, doc: Doc, text: bool) -> None:
        self.head = head  # through the piece string's opening quote
        self.tail = tail  # from its closing quote
        self.doc = doc  # the document the piece belongs to
        self.text = text

    def piece(self, payload: bytes) -> str | None:
        """The piece `payload` carries when it is this template's event with another piece
        in it; None when it is anything else."""
        head, tail = self.head, self.tail
        if not payload.startswith(head) or not payload.endswith(tail):
            return None
        start, end = len(head), len(payload) - len(tail)
        if end < start:
            return None
        try:
            # The string with its quotes (the head's last byte, the tail's first). Valid
            # only when what lies between is one string's body: a bare quote would end the
            # string early and leave the last quote over, and orjson also refuses control
            # characters, bad escapes, lone surrogates and invalid UTF-8.
            piece = orjson.loads(payload[start - 1 : end + 1])
        except orjson.JSONDecodeError:
            return None  # the general way parses it and says what is wrong
        return piece if type(piece) is str else None


def chat_template(payload: bytes, event: dict[str, Any], doc: Doc, text: bool) -> Template | None:
    """A template from `payload`, parsed as `event`: a chat event of one choice whose delta
    carries a piece of generated text (`text`) or of one tool call's arguments."""
    choice = event["choices"][0]
    delta = choice["delta"]
    if _other_text(delta, _CHAT_TEXT[1:] if text else _CHAT_TEXT):
        return None  # text beside the piece (or beside a call): read the general way
    if text:
        marked_delta = {**delta, "content": MARK}
    else:
        call = delta["tool_calls"][0]
        marked_call = {**call, "function": {**call["function"], "arguments": MARK}}
        marked_delta = {**delta, "tool_calls": [marked_call]}
    marked = {**event, "choices": [{**choice, "delta": marked_delta}]}
    return _template(payload, event, marked, doc, text)


def block_template(payload: bytes, event: dict[str, Any], doc: Doc, text: bool) -> Template | None:
    """A template from `payload`, parsed as `event`: an Anthropic `content_block_delta` whose
    delta carries a piece of text (`text_delta`) or of a tool's input (`input_json_delta`)."""
    delta = event["delta"]
    if _other_text(delta, _BLOCK_TEXT[1:] if text else _BLOCK_TEXT):
        return None
    marked = {**event, "delta": {**delta, "text" if text else "partial_json": MARK}}
    return _template(payload, event, marked, doc, text)


def _other_text(delta: dict[str, Any], fields: tuple[str, ...]) -> bool:
    return any(type(delta.get(f)) is str and delta.get(f) for f in fields)


def _template(
    payload: bytes, event: dict[str, Any], marked: dict[str, Any], doc: Doc, text: bool
) -> Template | None:
    """The bytes around the piece, from `marked` (the event with MARK in the piece's place)
    written by orjson; None when `event` written so is not `payload` (the engine writes its
    JSON another way), or the mark is not found once."""
    body = payload.lstrip(b" ")
    try:
        if orjson.dumps(event) != body:
            return None
        written = orjson.dumps(marked)
    except orjson.JSONEncodeError:
        return None  # nested deeper than orjson writes (it reads deeper): no shortcut
    at = written.find(_MARK_BYTES)
    if at < 0 or written.find(_MARK_BYTES, at + 1) >= 0:
        return None
    lead = payload[: len(payload) - len(body)]
    return Template(lead + written[:at], written[at + len(_MARK_BYTES) :], doc, text)
