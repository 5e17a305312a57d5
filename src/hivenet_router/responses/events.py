"""A chat completions stream as the Responses stream events.

`StreamShape` reads the chat stream's SSE events as they arrive and writes the Responses
events in the order OpenAI sends them, each with its `sequence_number`:
`response.created`, `response.in_progress`, then for each output item
`response.output_item.added`, its content part (`response.content_part.added`), deltas
(`response.output_text.delta`, `response.reasoning_text.delta`,
`response.function_call_arguments.delta`), their `.done` events and
`response.output_item.done`; last `response.completed`, or `response.incomplete` when the
output limit (or a content filter) cut the answer, or `response.failed` when the engine
sent an error inside the stream. The engine's usage event becomes the Response's `usage`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, Final

import orjson

from hivenet_router.responses.request import namespaced, new_id
from hivenet_router.responses.translate import INCOMPLETE, finish, name_call, text_part, usage

_CARRY_MAX = 1 << 22  # an event split across chunks kept up to this, then dropped


def _events(data: bytes) -> tuple[list[bytes], bytes]:
    """The `data:` payloads of the whole SSE events in `data` (its line ends made LF
    already), and what is left over."""
    cut = data.rfind(b"\n\n")
    if cut < 0:
        return [], data
    block = data[:cut]
    events = block.split(b"\n\n")
    if block.count(b"\n") == 2 * len(events) - 2:  # every event one line: the usual chunk
        return [e[5:].lstrip() for e in events if e.startswith(b"data:")], data[cut + 2 :]
    payloads = []
    for event in events:
        payload = _payload(event)
        if payload is not None:
            payloads.append(payload)
    return payloads, data[cut + 2 :]


def _payload(event: bytes) -> bytes | None:
    """An event's `data:` lines (None for none)."""
    if event.startswith(b"data:") and b"\n" not in event:  # one line: the usual event
        return event[5:].lstrip()
    lines = [line[5:].lstrip() for line in event.split(b"\n") if line.startswith(b"data:")]
    return b"\n".join(lines) if lines else None


# The bytes a JSON string's text holds only escaped: a text of valid UTF-8 without them is
# its own JSON, read as it is and written as it is by orjson (checked for every code
# point), so a token's text like that goes from the engine's event into the client's as
# it came.
_UNSAFE: Final = re.compile(rb'[\x00-\x1f"\\]')


def _read_texts(texts: list[bytes]) -> tuple[int, list[bytes], str]:
    """Token texts as `_tokens` reads them (each parsed as a JSON string), from the first
    while they parse: how many, the non-empty ones as orjson writes them, and all of them
    as one str. A text that is its own JSON (_UNSAFE) is not parsed."""
    joined = b"".join(texts)
    if joined.isascii() and _UNSAFE.search(joined) is None:  # the usual run
        return len(texts), texts if all(texts) else [t for t in texts if t], joined.decode()
    written: list[bytes] = []
    read: list[str] = []
    for taken, raw in enumerate(texts):
        try:
            if _UNSAFE.search(raw) is None:
                text = raw.decode()  # each: a character cut between two is two bad texts
            else:
                text = orjson.loads(b'"' + raw + b'"')
                raw = orjson.dumps(text)[1:-1]  # noqa: PLW2901 (as written)
        except (UnicodeDecodeError, orjson.JSONDecodeError):
            return taken, written, "".join(read)
        if text:
            written.append(raw)
            read.append(text)
    return len(texts), written, "".join(read)


# The delta members with text, and the output item kind each one's text goes to.
_TEXTS: Final = {"content": "message", "reasoning_content": "reasoning", "reasoning": "reasoning"}
_PROBE: Final = "\x00probe"
_LEARN_TRIES: Final = 8  # chat events a stream looks at for its token events' shape
Slot = tuple[bytes, bytes, str]  # a token event's bytes before and after its text, its kind
# A token event of a known shape as an SSE event: its bytes before its text's opening
# quote (from `data: `), from its closing quote to the end of its line, and between the
# texts of two such events in a row.
Frame = tuple[bytes, bytes, bytes]


def _slot(payload: bytes, event: dict[str, Any]) -> Slot | None:
    """Where the text is in `payload` (parsed: `event`), when it is a token event: its
    first choice's delta sets one text member, and nothing else `_read` acts on is set.
    Any event of the same bytes around another JSON string is then this event with that
    text, which the probe checks (the text found where orjson writes it, once, and a probe
    put there parsing as the event with the probe for text). None for any other event."""
    if event.get("error") is not None or event.get("usage") is not None:
        return None
    choices = event.get("choices")
    if type(choices) is not list or not choices or type(choice := choices[0]) is not dict:
        return None
    delta = choice.get("delta")
    if type(delta) is not dict or choice.get("finish_reason") is not None:
        return None
    if delta.get("tool_calls") is not None:
        return None
    names = [name for name in _TEXTS if delta.get(name) is not None]
    if len(names) != 1 or type(text := delta[names[0]]) is not str or not text:
        return None
    encoded = orjson.dumps(text)
    at = payload.find(encoded)
    if at < 0 or payload.find(encoded, at + 1) >= 0:
        return None
    head, tail = payload[:at], payload[at + len(encoded) :]
    try:
        probed = orjson.loads(head + orjson.dumps(_PROBE) + tail)
    except orjson.JSONDecodeError:
        return None
    delta[names[0]] = _PROBE
    same = probed == event
    delta[names[0]] = text
    return (head, tail, _TEXTS[names[0]]) if same else None


class StreamShape:
    """Chat SSE chunks in, Responses SSE bytes out. `on_done` gets the final Response and
    its JSON, the bytes the last event carries (before that event is sent, so a GET right
    after the stream finds it stored)."""

    def __init__(
        self, base: dict[str, Any], on_done: Callable[[dict[str, Any], bytes], None]
    ) -> None:
        self.response = base
        self._on_done = on_done
        self._seq = 0
        self._carry = b""
        self._started = False
        self.finished = False
        self._items: list[dict[str, Any]] = []
        self._current: dict[str, Any] | None = None  # the open message or reasoning item
        self._calls: dict[int, dict[str, Any]] = {}  # open function calls by chat index
        # The functions that came in a namespace, by the name the engine calls them.
        self._grouped = namespaced(base["tools"]) if base.get("tools") else {}
        self._reason: str | None = None
        self._usage: dict[str, Any] | None = None
        self._parts = (b"", b"", b"")  # the open item's delta event bytes (_delta_parts)
        self._quoted = self._parts  # the same with the quotes around the text (_run)
        self._slots: list[Slot] = []  # the token events' shapes (_slot), one a kind
        self._frames: dict[str, Frame] = {}  # the same as whole SSE events, by kind (_run)
        self._tries = _LEARN_TRIES

    def _event(self, out: list[bytes], kind: str, **fields: Any) -> None:
        body = orjson.dumps({"type": kind, "sequence_number": self._seq, **fields})
        self._seq += 1
        out.append(b"event: " + kind.encode() + b"\ndata: " + body + b"\n\n")

    def _response_event(self, out: list[bytes], kind: str, response: bytes) -> None:
        """`_event(out, kind, response=...)` with the Response's JSON made already: the
        same bytes (orjson writes a dict's members in order, without spaces)."""
        name = kind.encode()
        out.append(
            b"".join(
                (
                    b"event: ",
                    name,
                    b'\ndata: {"type":"',
                    name,
                    b'","sequence_number":',
                    str(self._seq).encode(),
                    b',"response":',
                    response,
                    b"}\n\n",
                )
            )
        )
        self._seq += 1

    def __call__(self, chunk: bytes) -> bytes:
        out: list[bytes] = []
        if not self._started:
            self._started = True
            start = orjson.dumps(self.response)  # once for both events
            self._response_event(out, "response.created", start)
            self._response_event(out, "response.in_progress", start)
        if self.finished:
            return b"".join(out)
        data = self._carry + chunk
        if b"\r" in data:
            data = data.replace(b"\r\n", b"\n")
        at = 0
        # While the token events' shapes are being learned, events one by one, so that the
        # tokens after the first in this chunk can be taken as a run of whole events (_run).
        while self._tries and self._frame() is None:
            end = data.find(b"\n\n", at)
            if end < 0:
                break
            payload = _payload(data[at:end])
            at = end + 2
            if payload is not None and self._one(out, payload, [], 0) < 0:
                return b"".join(out)
        at = self._run(out, data, at)
        payloads, self._carry = _events(data[at:] if at else data)
        if len(self._carry) > _CARRY_MAX:
            self._carry = b""
        at, count = 0, len(payloads)
        while at < count:
            at = self._one(out, payloads[at], payloads, at + 1)
            if at < 0:
                break
        return b"".join(out)

    def _one(self, out: list[bytes], payload: bytes, payloads: list[bytes], at: int) -> int:
        """Read one chat event (and the token events of the same item after it in
        `payloads`, from `at` on); returns where the next event is, -1 once finished."""
        slots = self._slots
        if slots and self._token(out, payload, slots):
            return self._tokens(out, payloads, at)
        if payload == b"[DONE]":
            self._end(out)
            return -1
        try:
            event = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return at
        if isinstance(event, dict):
            self._read(out, event)
            if self._tries and len(self._slots) < 2:
                self._learn(payload, event)
        return -1 if self.finished else at

    def _frame(self) -> Frame | None:
        """The open item's token events as whole SSE events, when their shape is known."""
        item = self._current
        return self._frames.get(item["type"]) if item is not None else None

    def _run(self, out: list[bytes], data: bytes, at: int) -> int:
        """Take the token events of the open item from `at` on in `data` (line ends made LF)
        while they are whole, in their known shape (_slot), and their text is a JSON
        string's: what `_token` would write for each, without parsing the event, nor its
        text when that is its own JSON (_read_texts). Returns where the first event not
        taken begins."""
        frame = self._frame()
        if frame is None or not data.startswith(frame[0], at):
            return at
        opener, closer, _between = frame
        skip, keep = len(opener), len(closer)
        end = data.find(b"\n\n", at)  # the first event first: a chunk of one token
        if end - at < skip + keep or not data.startswith(closer, end - keep):
            return at
        if not data.startswith(opener, end + 2):  # no second one: nothing to split
            texts = [data[at + skip : end - keep]]
        else:
            texts = self._texts(data[at:].split(b"\n\n"), frame)
        taken, written, text = _read_texts(texts)  # up to a text that is no JSON string
        if not taken:
            return at
        item = self._current
        assert item is not None
        if text:
            item["_text"].append(text)
        head, middle, tail = self._quoted
        seq = self._seq
        out.extend([b"%b%d%b%b%b" % (head, n, middle, t, tail) for n, t in enumerate(written, seq)])
        self._seq = seq + len(written)
        return at + taken * (skip + keep + 2) + sum(map(len, texts[:taken]))

    @staticmethod
    def _texts(events: list[bytes], frame: Frame) -> list[bytes]:
        """The texts of the token events in `frame`'s shape at the start of `events` (a
        split chunk: its last piece is what follows the last whole event)."""
        opener, closer, between = frame
        skip, keep = len(opener), len(closer)
        events.pop()
        count = len(events)  # the last ones may be others: the finish, the usage, [DONE]
        while count and not events[count - 1].endswith(closer):
            count -= 1
        texts = [event[skip:-keep] for event in events[:count]]
        if opener + between.join(texts) + closer == b"\n\n".join(events[:count]):
            return texts  # all token events: their texts put back give them again
        texts = []  # one by one
        for event in events:
            if not (event.startswith(opener) and event.endswith(closer)) or (
                len(event) < skip + keep  # the two overlap: no text between
            ):
                break
            texts.append(event[skip:-keep])
        return texts

    def _learn(self, payload: bytes, event: dict[str, Any]) -> None:
        self._tries -= 1
        slot = _slot(payload, event)
        if slot is not None and all(known[2] != slot[2] for known in self._slots):
            self._slots.append(slot)
            head, tail, kind = slot
            if b"\n" not in head and b"\n" not in tail:  # as one line, as engines send it
                opener, closer = b"data: " + head + b'"', b'"' + tail
                self._frames[kind] = (opener, closer, closer + b"\n\n" + opener)

    def _token(self, out: list[bytes], payload: bytes, slots: list[Slot]) -> bool:
        """Read a token event of a known shape from its bytes: what `_read` does with it
        (the text parsed as the JSON string it is); False for any other event."""
        for head, tail, kind in slots:
            if payload.startswith(head) and payload.endswith(tail):
                try:
                    text = orjson.loads(payload[len(head) : len(payload) - len(tail)])
                except orjson.JSONDecodeError:
                    return False
                if type(text) is not str:
                    return False
                if text:
                    self._delta(out, kind, text)
                return True
        return False

    def _tokens(self, out: list[bytes], payloads: list[bytes], at: int) -> int:
        """`_token` for the payloads from `at` on while they are tokens of the open item
        (the usual run: one a token), with what each needs at hand; returns where the
        run ended."""
        item = self._current
        slot = next((s for s in self._slots if item is not None and s[2] == item["type"]), None)
        if item is None or slot is None:
            return at
        head, tail, _kind = slot
        skip, keep = len(head), len(tail)
        texts = item["_text"]
        before, middle, after = self._parts
        seq = self._seq
        loads, dumps, append = orjson.loads, orjson.dumps, out.append
        count = len(payloads)
        while at < count:
            payload = payloads[at]
            if not (payload.startswith(head) and payload.endswith(tail)):
                break
            try:
                text = loads(payload[skip : len(payload) - keep])
            except orjson.JSONDecodeError:
                break
            if type(text) is not str:
                break
            if text:  # the bytes _delta writes
                texts.append(text)
                append(b"%b%d%b%b%b" % (before, seq, middle, dumps(text), after))
                seq += 1
            at += 1
        self._seq = seq
        return at

    def flush(self) -> bytes:
        """The events that end the Response, when the chat stream ended without [DONE]."""
        out: list[bytes] = []
        if not self.finished:
            self._end(out)
        return b"".join(out)

    # -- reading chat events ------------------------------------------------------------------

    def _read(self, out: list[bytes], event: dict[str, Any]) -> None:
        # Called once a token: a parsed event holds exact dicts, lists and strs, so the
        # checks are by type, and absent members cost one lookup.
        error = event.get("error")
        if type(error) is dict:
            self._fail(out, error)
            return
        if (counts := event.get("usage")) is not None and (found := usage(counts)) is not None:
            self._usage = found
        choices = event.get("choices")
        if type(choices) is not list or not choices or type(choice := choices[0]) is not dict:
            return
        delta = choice.get("delta")
        if type(delta) is dict:
            thought = delta.get("reasoning_content") or delta.get("reasoning")
            if thought and type(thought) is str:
                self._delta(out, "reasoning", thought)
            content = delta.get("content")
            if content and type(content) is str:
                self._delta(out, "message", content)
            calls = delta.get("tool_calls")
            if type(calls) is list:
                for call in calls:
                    if type(call) is dict:
                        self._call(out, call)
        reason = choice.get("finish_reason")
        if type(reason) is str:
            self._reason = reason

    def _delta(self, out: list[bytes], kind: str, text: str) -> None:
        item = self._current
        if item is None or item["type"] != kind:
            self._close_current(out)
            item = self._open(out, kind)
        item["_text"].append(text)
        # One event a token: written from the open item's bytes (_delta_parts), the same
        # bytes _event would write for it.
        head, middle, tail = self._parts
        out.append(head + str(self._seq).encode() + middle + orjson.dumps(text) + tail)
        self._seq += 1

    def _delta_parts(self, kind: str, item_id: str, index: int) -> tuple[bytes, bytes, bytes]:
        """The bytes of the item's delta events around their sequence number and text:
        `_event(out, name, item_id=..., output_index=..., content_index=0, delta=text,
        logprobs=[])` (no logprobs for reasoning) in three pieces."""
        name = (
            b"response.output_text.delta" if kind == "message" else b"response.reasoning_text.delta"
        )
        head = b"event: " + name + b'\ndata: {"type":"' + name + b'","sequence_number":'
        middle = b',"item_id":' + orjson.dumps(item_id) + b',"output_index":'
        middle += str(index).encode() + b',"content_index":0,"delta":'
        tail = b',"logprobs":[]}\n\n' if kind == "message" else b"}\n\n"
        return head, middle, tail

    def _open(self, out: list[bytes], kind: str) -> dict[str, Any]:
        if kind == "message":
            shown: dict[str, Any] = {
                "type": "message",
                "id": new_id("msg"),
                "role": "assistant",
                "status": "in_progress",
                "content": [],
            }
            part: dict[str, Any] = text_part("")
        else:
            shown = {"type": "reasoning", "id": new_id("rs"), "summary": [], "content": []}
            part = {"type": "reasoning_text", "text": ""}
        index = len(self._items)
        self._event(out, "response.output_item.added", output_index=index, item=shown)
        self._event(
            out,
            "response.content_part.added",
            item_id=shown["id"],
            output_index=index,
            content_index=0,
            part=part,
        )
        item = {**shown, "_index": index, "_text": []}
        self._items.append(item)
        self._current = item
        self._parts = head, middle, tail = self._delta_parts(kind, shown["id"], index)
        self._quoted = head, middle + b'"', b'"' + tail
        return item

    def _call(self, out: list[bytes], call: dict[str, Any]) -> None:
        index = call.get("index", 0)
        index = index if isinstance(index, int) else 0
        item = self._calls.get(index)
        function: dict[str, Any] = (
            call["function"] if isinstance(call.get("function"), dict) else {}
        )
        if item is None:
            self._close_current(out)
            shown = {
                "type": "function_call",
                "id": new_id("fc"),
                "call_id": call["id"] if isinstance(call.get("id"), str) else new_id("call"),
                "name": function["name"] if isinstance(function.get("name"), str) else "",
                "arguments": "",
                "status": "in_progress",
            }
            if self._grouped:
                name_call(shown, self._grouped)
            item = {**shown, "_index": len(self._items), "_text": []}
            self._items.append(item)
            self._calls[index] = item
            self._event(out, "response.output_item.added", output_index=item["_index"], item=shown)
        elif isinstance(function.get("name"), str) and not item["name"]:
            item["name"] = function["name"]
            if self._grouped:
                name_call(item, self._grouped)
        arguments = function.get("arguments")
        if isinstance(arguments, str) and arguments:
            item["_text"].append(arguments)
            self._event(
                out,
                "response.function_call_arguments.delta",
                item_id=item["id"],
                output_index=item["_index"],
                delta=arguments,
            )

    # -- closing ----------------------------------------------------------------------------------

    def _status(self) -> str:
        return "incomplete" if self._reason in INCOMPLETE else "completed"

    def _close_current(self, out: list[bytes]) -> None:
        item, self._current = self._current, None
        if item is None:
            return
        text = "".join(item.pop("_text"))
        index = item.pop("_index")
        if item["type"] == "message":
            part = text_part(text)
            self._event(
                out,
                "response.output_text.done",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                text=text,
                logprobs=[],
            )
        else:
            part = {"type": "reasoning_text", "text": text}
            self._event(
                out,
                "response.reasoning_text.done",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                text=text,
            )
        self._event(
            out,
            "response.content_part.done",
            item_id=item["id"],
            output_index=index,
            content_index=0,
            part=part,
        )
        item["content"] = [part]
        item["status"] = self._status()
        self._event(out, "response.output_item.done", output_index=index, item=item)

    def _close_call(self, out: list[bytes], item: dict[str, Any], last: bool = False) -> None:
        arguments = "".join(item.pop("_text"))
        index = item.pop("_index")
        item["arguments"] = arguments
        # An answer cut short (its token limit) cut its last call's arguments.
        item["status"] = self._status() if last else "completed"
        self._event(
            out,
            "response.function_call_arguments.done",
            item_id=item["id"],
            output_index=index,
            name=item["name"],
            arguments=arguments,
        )
        self._event(out, "response.output_item.done", output_index=index, item=item)

    def _end(self, out: list[bytes]) -> None:
        self._close_current(out)
        order = sorted(self._calls)
        for index in order:
            self._close_call(out, self._calls[index], last=index == order[-1])
        self._calls = {}
        response = dict(self.response)
        response["output"] = self._items
        finish(response, self._reason, self._usage)
        self._last(out, response)

    def _fail(self, out: list[bytes], error: dict[str, Any]) -> None:
        response = dict(self.response)
        response["output"] = [i for i in self._items if "_index" not in i]
        response["status"] = "failed"
        response["error"] = {
            "code": str(error.get("code") or "server_error"),
            "message": str(error.get("message") or "the engine failed"),
        }
        self._last(out, response)

    def _last(self, out: list[bytes], response: dict[str, Any]) -> None:
        self.finished = True
        self.response = response
        encoded = orjson.dumps(response)  # once, for the client and the store
        self._on_done(response, encoded)
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}
        self._response_event(out, kind.get(response["status"], "response.failed"), encoded)
