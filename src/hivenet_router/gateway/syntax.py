"""Is a model's answer well formed? The stream validator's syntax judge.

What the request asks for (`Asked`, read once from its body): JSON text (`response_format`
`json_object`/`json_schema` on chat and completions, Anthropic `output_format`, Responses
`text.format`), possibly fitting a schema, and the tools it offers with their parameter
schemas. The judge (`SyntaxJudge`) is handed the answer's events as `SseText` parses them
(or the whole body) and checks, as each piece arrives:

- `json`: the text asked to be JSON can still become JSON (`jsonprefix.JsonPrefix`: the
  first character that no continuation could fix is a failure at once), and is complete
  when the answer stops (an answer cut by its token limit is not judged unfinished: the
  client's limit cut it);
- `schema`: the value, once complete, fits the requested schema (`schema_subset`);
- `tool_args`: each tool call's arguments are JSON, and once complete fit that tool's
  parameters (a call of a tool the request did not offer is judged as JSON only);
- `events`: every line is an SSE field, every `data:` payload JSON of the route's shape.

Each piece is read once: the JSON checker keeps state, not text; only a value that a schema
will judge is kept, and parsed once when it completes. `reason` is None while the answer is
sound, else `<check>: <why>` (and stays so). Pure: no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import orjson

from hivenet_router.gateway.jsonprefix import DONE, JsonPrefix
from hivenet_router.gateway.schema_subset import violation
from hivenet_router.gateway.settings import SyntaxSettings
from hivenet_router.gateway.syntax_quick import Template, block_template, chat_template

CHECKS: Final = ("json", "schema", "tool_args", "events")
CHAT: Final = "/v1/chat/completions"
COMPLETIONS: Final = "/v1/completions"
MESSAGES: Final = "/v1/messages"
RESPONSES: Final = "/v1/responses"
ROUTES: Final = frozenset({CHAT, COMPLETIONS, MESSAGES, RESPONSES})
# A request without one of these asks for no structure (read before the body is parsed).
_HINTS: Final = (b'"response_format"', b'"tools"', b'"output_format"', b'"format"')
MAX_REASON: Final = 200  # characters of a reason kept
_CUT: Final = frozenset({"length", "max_tokens", "max_output_tokens"})
# Event shapes kept for `quick` per answer that read fewer than PAID events: enough for each
# tool call of an answer, and an engine whose every event differs (a count in each) stops
# paying for them soon.
MAX_TEMPLATES: Final = 8
PAID: Final = 4  # events read by a template that make it worth its making


@dataclass(frozen=True, slots=True)
class Asked:
    """What a request asks of the answer's form."""

    route: str
    json: bool = False  # the generated text must be one JSON document
    object_only: bool = False  # ... an object (`json_object`)
    schema: Any = None  # the schema that document must fit (None: any)
    tools: Mapping[str, Any] = field(default_factory=dict)  # offered tool -> its parameters

    @property
    def structured(self) -> bool:
        return self.json or bool(self.tools)


def asked(route: str, body: bytes) -> Asked | None:
    """What the request `body` for `route` asks for; None for a route that generates no
    text, or a body that is no JSON object (the engine refuses it anyway)."""
    if route not in ROUTES:
        return None
    if not any(hint in body for hint in _HINTS):
        return Asked(route)
    try:
        request = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(request, dict):
        return None
    if route == MESSAGES:
        fmt = request.get("output_format")
    elif route == RESPONSES:
        text = request.get("text")
        fmt = text.get("format") if isinstance(text, dict) else None
    else:
        fmt = request.get("response_format")
    json_asked, object_only, schema = _format(fmt)
    return Asked(route, json_asked, object_only, schema, _tools(route, request.get("tools")))


def _format(fmt: Any) -> tuple[bool, bool, Any]:
    """(JSON asked, an object only, the schema) from a response format in any API's shape:
    OpenAI `{type: json_schema, json_schema: {schema}}`, Anthropic and Responses
    `{type: json_schema, schema}`, and `{type: json_object}`."""
    if not isinstance(fmt, dict):
        return False, False, None
    kind = fmt.get("type")
    if kind == "json_object":
        return True, True, None
    if kind != "json_schema":
        return False, False, None
    spec = fmt.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else fmt.get("schema")
    return True, False, schema if isinstance(schema, dict) else None


def _tools(route: str, tools: Any) -> dict[str, Any]:
    """Offered tools by name, with their parameter schemas (None when a tool has none)."""
    out: dict[str, Any] = {}
    for tool in tools if isinstance(tools, list) else []:
        if not isinstance(tool, dict):
            continue
        if route == MESSAGES:
            name, schema = tool.get("name"), tool.get("input_schema")
        elif isinstance(tool.get("function"), dict):
            name, schema = tool["function"].get("name"), tool["function"].get("parameters")
        else:  # Responses: {type: function, name, parameters}
            name, schema = tool.get("name"), tool.get("parameters")
        if isinstance(name, str):
            out[name] = schema if isinstance(schema, dict) else None
    return out


class Doc:
    """One JSON text being judged: generated content, or one tool call's arguments."""

    __slots__ = ("check", "ended", "judged", "parts", "prefix", "schema", "what")

    def __init__(self, check: str, what: str, schema: Any, object_only: bool) -> None:
        self.check = check  # "json" or "tool_args": the check its syntax counts under
        self.what = what  # where it is, for the reason
        self.schema = schema  # None: syntax only
        self.prefix = JsonPrefix(object_only)
        self.parts: list[str] | None = [] if schema is not None else None
        self.judged = False  # the schema has had its say
        self.ended = False

    def feed(self, text: str) -> str | None:
        bad = self.prefix.feed(text)
        if bad is not None:
            return f"{self.check}: {self.what} is no JSON from character {bad}"
        if self.parts is not None:
            self.parts.append(text)
            if self.prefix.state == DONE:
                return self._fits()
        return None

    def end(self, cut: bool) -> str | None:
        """The text is over; `cut`: by the token limit, so an unfinished one is no fault."""
        if self.ended:
            return None
        self.ended = True
        if self.prefix.seen == 0 and self.check == "tool_args":
            self.feed("{}")  # a call without arguments: some engines send none at all
        if self.prefix.error is not None or not self.prefix.complete:
            if cut:
                return None
            return f"{self.check}: {self.what}: {self.prefix.finish()}"
        return self._fits() if self.parts is not None else None

    def _fits(self) -> str | None:
        if self.judged or self.parts is None:
            return None
        self.judged = True
        text, self.parts = "".join(self.parts), None
        try:
            value = orjson.loads(text)
        except orjson.JSONDecodeError:
            value = json.loads(text)  # integers beyond 64 bits, lone surrogates
        problem = violation(value, self.schema)
        return None if problem is None else f"schema: {self.what}: {problem}"


class SyntaxJudge:
    """Feed it the answer's events in order (`event`, `bad`, then `finish` at its end), or
    its whole body (`body`); `reason` says what broke first, `check` under which check."""

    __slots__ = (
        "_asked",
        "_builds",
        "_calls",
        "_chat",
        "_cut",
        "_hits",
        "_json",
        "_on",
        "_template",
        "_texts",
        "check",
        "reason",
    )

    def __init__(self, asked: Asked, settings: SyntaxSettings) -> None:
        self._asked = asked
        on = settings.structured if asked.structured else settings.free_text
        self._on = frozenset(c for c in CHECKS if on and getattr(settings, c))
        self._json = asked.json and "json" in self._on  # generated text is judged as JSON
        self._chat = asked.route in (CHAT, COMPLETIONS)  # events with choices
        self._texts: dict[int, Doc] = {}  # generated text by choice
        self._calls: dict[tuple[int, int], Doc] = {}  # tool calls by (choice, index)
        self._cut = False  # the answer stopped at its token limit
        self._template: Template | None = None  # the last plain event's shape (`quick`)
        self._builds = 0  # templates made for this answer that did not pay for themselves
        self._hits = 0  # events the current template read
        self.reason: str | None = None
        self.check: str | None = None

    @property
    def active(self) -> bool:
        return bool(self._on)

    def bad(self, why: str) -> None:
        """A line that is no SSE field, or a payload that is no JSON."""
        if "events" in self._on:
            self._fail(f"events: {why}")

    def quick(self, payload: bytes) -> str | None:
        """A `data:` payload read without parsing it, when it is the last plain event's
        shape with another piece in it (syntax_quick): the text it carries for the loop
        detector ("" for a piece of a tool call). None: parse it and hand it to `event`."""
        shape = self._template
        if shape is None:
            return None
        piece = shape.piece(payload)
        if piece is None:
            return None
        self._hits += 1
        if piece and self.reason is None:
            problem = shape.doc.feed(piece)
            if problem is not None:
                self._fail(problem)
        return piece if shape.text else ""

    def event(self, event: Any, payload: bytes | None = None) -> None:
        """One parsed `data:` payload (with its bytes, when the caller has them: the plain
        event's shape is kept from them for `quick`)."""
        if self.reason is not None:
            return
        if type(event) is not dict:
            self.bad("an event that is no JSON object")
            return
        if "error" in event and event.get("type") in (None, "error"):
            return  # the engine's own error event: passed on as it is, not judged here
        if not self._chat:
            if self._asked.route == MESSAGES:
                self._anthropic(event, payload)
            else:
                self._responses(event)
            return
        choices = event.get("choices")
        if type(choices) is not list:
            self.bad("an event without choices")
            return
        if len(choices) == 1:
            # The common chat event, kept short: one choice under way whose delta carries a
            # piece of text, or of one tool call, already opened; anything else goes the
            # general way below (which reads it from the start: nothing is judged here).
            choice = choices[0]
            delta = choice.get("delta") if type(choice) is dict else None
            if type(delta) is dict and choice.get("finish_reason") is None:
                if "tool_calls" not in delta:
                    content = delta.get("content")
                    if not content or not self._json:
                        return  # a role, an empty delta, or text not asked to be JSON
                    index = choice.get("index", 0)
                    doc = self._texts.get(index) if type(index) is int else None
                else:
                    doc, content = self._call_piece(choice, delta)
                if doc is not None and type(content) is str:
                    if content:
                        problem = doc.feed(content)
                        if problem is not None:
                            self._fail(problem)
                    if payload is not None and self._keep_shape():
                        text = "tool_calls" not in delta
                        self._template = chat_template(payload, event, doc, text)
                    return
        for choice in choices:
            if type(choice) is dict:
                self._choice(choice, choice.get("delta"))

    def _keep_shape(self) -> bool:
        """May this plain event's shape be kept? Always when the last one read enough
        events (an engine whose envelope changes now and then, its `created` second), else
        up to MAX_TEMPLATES times (an engine whose every event differs stops paying)."""
        if self._hits < PAID:
            if self._builds >= MAX_TEMPLATES:
                return False
            self._builds += 1
        self._hits = 0
        return True

    def _call_piece(self, choice: dict[str, Any], delta: dict[str, Any]) -> tuple[Doc | None, Any]:
        """The tool call an event's delta continues, and its piece of arguments; None when
        it is anything else (no content beside, one call, already opened)."""
        calls = delta["tool_calls"]
        if type(calls) is not list or len(calls) != 1 or delta.get("content"):
            return None, None
        call = calls[0]
        function = call.get("function") if type(call) is dict else None
        if type(function) is not dict:
            return None, None
        index, at = choice.get("index", 0), call.get("index", 0)
        if type(index) is not int or type(at) is not int:
            return None, None
        return self._calls.get((index, at)), function.get("arguments")

    def finish(self) -> str | None:
        """The answer is over: every text still open must be complete."""
        for doc in (*self._texts.values(), *self._calls.values()):
            self._result(doc.end(self._cut))
        return self.reason

    def body(self, value: Any) -> str | None:
        """A whole answer's parsed body, judged at once."""
        if not isinstance(value, dict):
            self.bad("a body that is no JSON object")
        elif self._asked.route == MESSAGES:
            self._anthropic_body(value)
        elif self._asked.route == RESPONSES:
            self._responses_body(value)
        else:
            choices = value.get("choices")
            if not isinstance(choices, list):
                self.bad("a body without choices")
            for choice in choices if isinstance(choices, list) else []:
                if isinstance(choice, dict):
                    self._choice(choice, choice.get("message"))
        return self.finish()

    # -- the pieces -----------------------------------------------------------------------------

    def _fail(self, reason: str) -> None:
        if self.reason is None:
            # Names in it come from the model's output (keys, a tool's name): bounded, as
            # the reason goes to the audit record and the error message.
            self.reason = reason if len(reason) <= MAX_REASON else reason[:MAX_REASON] + "..."
            self.check = reason.partition(":")[0]

    def _result(self, problem: str | None) -> None:
        if problem is not None:
            self._fail(problem)

    def _text(self, key: int, piece: Any) -> None:
        if not self._json or not piece or type(piece) is not str:
            return
        doc = self._texts.get(key)
        if doc is None:
            schema = self._asked.schema if "schema" in self._on else None
            what = "the answer" if key == 0 else f"choice {key}'s answer"
            doc = self._texts[key] = Doc("json", what, schema, self._asked.object_only)
        self._result(doc.feed(piece))

    def _call(self, key: tuple[int, int], name: Any, piece: Any) -> Doc | None:
        """Tool call `key`, started with its `name` or continued with a `piece` of it."""
        if "tool_args" not in self._on:
            return None
        doc = self._calls.get(key)
        if doc is None:
            schema: Any = None
            if "schema" in self._on and isinstance(name, str):
                schema = self._asked.tools.get(name)
            doc = self._calls[key] = Doc("tool_args", f"{name}'s arguments", schema, False)
        if isinstance(piece, str) and piece:
            self._result(doc.feed(piece))
        return doc

    def _choice(self, choice: dict[str, Any], part: Any) -> None:
        """An OpenAI choice: chat `delta` (stream) or `message` (body), or completions
        `text`; its end when it has a finish reason."""
        index = choice.get("index", 0)
        if type(index) is not int:
            index = 0
        if type(part) is dict:
            content = part.get("content")
            if content and self._json:
                doc = self._texts.get(index)
                if doc is not None and type(content) is str:
                    problem = doc.feed(content)  # the common case, kept short
                    if problem is not None:
                        self._fail(problem)
                else:
                    self._text(index, content)
            calls = part.get("tool_calls")
            if calls:
                self._tool_calls(index, calls)
        else:
            self._text(index, choice.get("text"))
        finish = choice.get("finish_reason")
        if finish is not None:
            self._finished(index, finish)

    def _tool_calls(self, index: int, calls: Any) -> None:
        if type(calls) is not list:
            return
        for position, call in enumerate(calls):
            if type(call) is not dict:
                continue
            at = call.get("index", position)
            key = (index, at if type(at) is int else position)
            function = call.get("function")
            if type(function) is not dict:
                function = {}
            doc = self._calls.get(key)
            piece = function.get("arguments")
            if doc is not None and type(piece) is str:
                if piece:  # the common case, kept short: a piece of a call under way
                    self._result(doc.feed(piece))
            else:
                self._call(key, function.get("name"), piece)

    def _finished(self, index: int, finish: Any) -> None:
        """Choice `index` stopped: its texts must be whole (unless cut by the limit)."""
        cut = _is_cut(finish)
        self._cut = self._cut or cut
        text = self._texts.get(index)
        if text is not None:
            self._result(text.end(cut))
        for (owner, _), doc in self._calls.items():
            if owner == index:
                self._result(doc.end(cut))

    def _anthropic(self, event: dict[str, Any], payload: bytes | None) -> None:
        kind = event.get("type")
        if not isinstance(kind, str):
            self.bad("an event without a type")
            return
        if kind == "content_block_delta":
            delta = event.get("delta")
            if not isinstance(delta, dict):
                return
            doc: Doc | None = None
            if delta.get("type") == "text_delta":
                piece = delta.get("text")
                self._text(0, piece)
                doc = self._texts.get(0) if self._json else None
            elif delta.get("type") == "input_json_delta":
                piece = delta.get("partial_json")
                doc = self._call((0, _index(event)), None, piece)
            if (
                doc is not None
                and type(piece) is str
                and payload is not None
                and self._keep_shape()
            ):
                text = delta["type"] == "text_delta"
                self._template = block_template(payload, event, doc, text)
        elif kind == "content_block_start":
            block = event.get("content_block")
            if isinstance(block, dict) and block.get("type") == "tool_use":
                self._call((0, _index(event)), block.get("name"), None)
        elif kind == "message_delta":
            delta = event.get("delta")
            stop = delta.get("stop_reason") if isinstance(delta, dict) else None
            if stop is not None:
                self._cut = _is_cut(stop)
                self.finish()

    def _anthropic_body(self, value: dict[str, Any]) -> None:
        self._cut = _is_cut(value.get("stop_reason"))
        content = value.get("content")
        if not isinstance(content, list):
            self.bad("a body without content")
            return
        for position, block in enumerate(content):
            if not isinstance(block, dict):
                continue
            if block.get("type") == "text":
                self._text(0, block.get("text"))
            elif block.get("type") == "tool_use":
                doc = self._call((0, position), block.get("name"), None)
                if doc is not None:  # the input came parsed: its schema is all to judge
                    doc.ended = True
                    problem = violation(block.get("input"), doc.schema) if doc.schema else None
                    self._result(None if problem is None else f"schema: {doc.what}: {problem}")

    def _responses(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        if not isinstance(kind, str):
            self.bad("an event without a type")
        elif kind == "response.output_text.delta":
            self._text(0, event.get("delta"))
        elif kind == "response.output_item.added":
            item = event.get("item")
            if isinstance(item, dict) and item.get("type") == "function_call":
                self._call((0, _index(event, "output_index")), item.get("name"), None)
        elif kind == "response.function_call_arguments.delta":
            self._call((0, _index(event, "output_index")), None, event.get("delta"))
        elif kind in ("response.completed", "response.incomplete"):
            self._cut = kind == "response.incomplete"
            self.finish()

    def _responses_body(self, value: dict[str, Any]) -> None:
        self._cut = value.get("status") == "incomplete"
        output = value.get("output")
        for position, item in enumerate(output if isinstance(output, list) else []):
            if not isinstance(item, dict):
                continue
            if item.get("type") == "function_call":
                self._call((0, position), item.get("name"), item.get("arguments"))
            content = item.get("content") if item.get("type") == "message" else None
            for part in content if isinstance(content, list) else []:
                if isinstance(part, dict) and part.get("type") == "output_text":
                    self._text(0, part.get("text"))


def _index(event: dict[str, Any], name: str = "index") -> int:
    index = event.get(name, 0)
    return index if isinstance(index, int) else 0


def _is_cut(reason: Any) -> bool:
    """Did the answer stop at its token limit?"""
    return isinstance(reason, str) and reason in _CUT
