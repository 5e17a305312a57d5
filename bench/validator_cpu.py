"""The stream validator's CPU per chunk: repetition alone against repetition and syntax.

    python -m bench.validator_cpu
    python -m bench.validator_cpu --chunks 400 --rounds 30

In process, no network: the same SSE chunks a local engine streams (OpenAI chat chunks with
the envelope vLLM sends, one token of content each) are fed to what the validator runs per
chunk: `SseText` and the loop `Detector` ("repetition"), and the same with the syntax judge
on its `SseText` ("syntax on": json, schema, tool_args and events checks). Three answers:

- `json`: a structured answer (`response_format` json_schema) of nested records;
- `tool`: a forced tool call whose arguments stream in small pieces;
- `text`: free text, where the default settings make no judge at all.

Two levels: `parse` feeds the chunks straight to those objects; `stage` runs the whole
`StreamValidator` stage over an in-memory answer (held window, release, the watched rest,
read as the relay reads it), with `syntax: false` against the default (syntax on for
structured requests), so the per-chunk cost includes what every chunk costs the stage.

Each case is timed over `--rounds` rounds (best round kept: the least disturbed by other
work on the machine), in microseconds per chunk; the last column is syntax on over
repetition alone.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Callable

import orjson

from hivenet_router.domain.answer import Answer, Outcome
from hivenet_router.domain.request import Job
from hivenet_router.gateway.blocks import VALIDATOR
from hivenet_router.gateway.degenerate import Detector
from hivenet_router.gateway.settings import SYNTAX_OFF, SyntaxSettings, ValidatorSettings
from hivenet_router.gateway.sse_text import SseText
from hivenet_router.gateway.syntax import CHAT, MESSAGES, Asked, SyntaxJudge, asked
from hivenet_router.gateway.validator import StreamValidator
from hivenet_router.observability.events import Observers
from hivenet_router.pipeline.ticket import Ticket
from hivenet_router.policy.document import BUILT_IN, Policy
from hivenet_router.sim.text import Corpus

SCHEMA = {
    "type": "object",
    "properties": {
        "trips": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "notes": {"type": "string"},
                },
                "required": ["city", "days"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["trips"],
}
ENVELOPE = {
    "id": "chatcmpl-5f1d7c2a9b8e4c3d",
    "object": "chat.completion.chunk",
    "created": 1765000000,
    "model": "llama-3.1-8b-instruct",
    "system_fingerprint": None,
}


def chunk(delta: dict[str, object], finish: str | None = None) -> bytes:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    return b"data: " + orjson.dumps({**ENVELOPE, "choices": [choice]}) + b"\n\n"


def tokens(text: str, size: int = 4) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


def answer_json(count: int) -> list[bytes]:
    """A whole document of about `count` tokens (four characters each)."""
    words = Corpus(3).answer(b"notes", count)
    trips: list[dict[str, object]] = []
    text = ""
    while len(text) < count * 4:
        at = len(trips) % max(1, len(words) - 6)
        trips.append(
            {
                "city": f"City {len(trips)}",
                "days": len(trips) % 9,
                "notes": "".join(words[at : at + 6]),
            }
        )
        text = orjson.dumps({"trips": trips}, option=orjson.OPT_INDENT_2).decode()
    return [chunk({"content": piece}) for piece in tokens(text)]


def tool_arguments(count: int) -> str:
    """A tool call's arguments of about `count` tokens (four characters each)."""
    trips: list[dict[str, object]] = []
    text = ""
    while len(text) < count * 4:
        trips.append({"city": f"C{len(trips)}", "days": len(trips) % 9})
        text = orjson.dumps({"trips": trips}).decode()
    return text


def answer_tool(count: int) -> list[bytes]:
    """A forced tool call whose arguments make about `count` tokens."""
    text = tool_arguments(count)
    head = {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                            "function": {"name": "plan", "arguments": ""}}]}  # fmt: skip
    rest = [{"tool_calls": [{"index": 0, "function": {"arguments": p}}]} for p in tokens(text)]
    return [chunk(head), *(chunk(d) for d in rest)]


def answer_atool(count: int) -> list[bytes]:
    """The tool call of `answer_tool` as Anthropic's messages stream it (`input_json_delta`)."""
    text = tool_arguments(count)

    def event(value: dict[str, object]) -> bytes:
        name = str(value["type"]).encode()
        return b"event: " + name + b"\ndata: " + orjson.dumps(value) + b"\n\n"

    block = {"type": "tool_use", "id": "toolu_1", "name": "plan", "input": {}}
    head = event({"type": "content_block_start", "index": 0, "content_block": block})
    rest = [
        event({"type": "content_block_delta", "index": 0,
               "delta": {"type": "input_json_delta", "partial_json": piece}})
        for piece in tokens(text)
    ]  # fmt: skip
    return [head, *rest]


def answer_text(count: int) -> list[bytes]:
    return [chunk({"content": t}) for t in Corpus(5).answer(b"prose", count)]


REQUESTS = {
    "json": {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
    "tool": {"tools": [{"type": "function", "function": {"name": "plan", "parameters": SCHEMA}}]},
    "text": {"messages": [{"role": "user", "content": "hello"}]},
    "atool": {"tools": [{"name": "plan", "input_schema": SCHEMA}]},
}
ROUTES = {"atool": MESSAGES}


def run(chunks: list[bytes], make: Callable[[], tuple[SseText, Detector]]) -> None:
    text, detector = make()
    for piece in chunks:
        detector.feed_all(text.feed(piece))


def timed(chunks: list[bytes], make: Callable[[], tuple[SseText, Detector]], rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        started = time.process_time()
        run(chunks, make)
        best = min(best, time.process_time() - started)
    return best / len(chunks) * 1e6


class Chunks:
    """A local answer's source: the chunks, then the end."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = iter(chunks)

    async def read(self) -> bytes | None:
        return next(self.chunks, None)

    def close(self, outcome: Outcome) -> None:
        pass


async def through_stage(
    chunks: list[bytes], request: bytes, settings: ValidatorSettings, route: str = CHAT
) -> None:
    policy = Policy("p", ("m",), BUILT_IN.steps).with_block(VALIDATOR, settings)
    ticket = Ticket("rid", route, 0.0, Observers())
    ticket.job = Job(route, "m", "llm", True, request, [])
    ticket.policy = policy
    end = END if route == CHAT else ANTHROPIC_END
    local = Answer(200, [], Chunks([*chunks[1:], end]), first=chunks[0], origin="peer")

    async def dispatch(_: Ticket) -> Answer:
        return local

    async def provider(_: Ticket) -> Answer:
        raise AssertionError("the bench's answers are sound")

    answer = await StreamValidator(provider)(ticket, dispatch)
    while await answer.next_chunk() is not None:
        pass
    await answer.close(Outcome.OK)


def timed_stage(
    chunks: list[bytes], request: bytes, syntax: bool, rounds: int, route: str = CHAT
) -> float:
    settings = ValidatorSettings(syntax=SyntaxSettings() if syntax else SYNTAX_OFF)
    best = float("inf")
    loop = asyncio.new_event_loop()
    try:
        for _ in range(rounds):
            started = time.process_time()
            loop.run_until_complete(through_stage(chunks, request, settings, route))
            best = min(best, time.process_time() - started)
    finally:
        loop.close()
    return best / len(chunks) * 1e6


END = chunk({}, "stop") + b"data: [DONE]\n\n"
ANTHROPIC_END = (
    b'event: content_block_stop\ndata: {"type":"content_block_stop","index":0}\n\n'
    b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"tool_use"}}\n\n'
    b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    settings = ValidatorSettings()
    answers = {"json": answer_json, "tool": answer_tool, "atool": answer_atool, "text": answer_text}
    head = f"{'level':<7}{'answer':<8}{'repetition us/chunk':>22}{'syntax on us/chunk':>22}"
    print(f"{head}{'ratio':>8}")
    for name, build in answers.items():
        chunks = build(args.chunks)
        route = ROUTES.get(name, CHAT)
        form = asked(route, orjson.dumps(REQUESTS[name]))
        assert form is not None

        def alone() -> tuple[SseText, Detector]:
            return SseText(), Detector(settings)

        def judged(form: Asked = form) -> tuple[SseText, Detector]:
            judge = SyntaxJudge(form, SyntaxSettings())
            return SseText(judge if judge.active else None), Detector(settings)

        judge = SyntaxJudge(form, SyntaxSettings())
        text = SseText(judge if judge.active else None)
        for piece in chunks:
            text.feed(piece)
        assert judge.reason is None, judge.reason  # the bench's answers are sound
        base = timed(chunks, alone, args.rounds)
        both = timed(chunks, judged, args.rounds)
        print(f"{'parse':<7}{name:<8}{base:>22.2f}{both:>22.2f}{both / base:>8.2f}")
        request = orjson.dumps(REQUESTS[name])
        base = timed_stage(chunks, request, False, args.rounds, route)
        both = timed_stage(chunks, request, True, args.rounds, route)
        print(f"{'stage':<7}{name:<8}{base:>22.2f}{both:>22.2f}{both / base:>8.2f}")


if __name__ == "__main__":
    main()
