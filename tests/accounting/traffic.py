"""Seeded mixed traffic through the official SDKs, with the faults woven into it.

`plan(seed, count, tenants)` fixes every request: tenant, router, route and shape (chat,
completions, messages; whole or streamed; streams with and without
`stream_options.include_usage`), `max_tokens` or none, `n`, a cacheable repeat
(`temperature: 0`, a prompt from a small pool) or not, and for some streams the chunk after
which the client hangs up. `run` sends them from a few threads, in plan order, and fires
fault `i` when request `start_i` is taken; requests from `end_i` on wait until that fault
is over (its recovery reached), so each fault overlaps the same requests in every run.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import anthropic
import openai

from tests.accounting.fleet import MODEL, Fleet, Tenant

SHAPES = (
    "chat",
    "chat_stream",
    "chat_stream_usage",
    "completion",
    "completion_stream",
    "completion_stream_usage",
    "messages",
    "messages_stream",
)
CACHED_SHAPES = ("chat", "chat_stream", "messages_stream")
WORDS = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa")
CLIENT_TIMEOUT = 30.0


@dataclass(frozen=True)
class Call:
    index: int
    tenant: Tenant
    router: int
    shape: str
    prompt: str
    max_tokens: int | None
    n: int
    cacheable: bool
    hangup: int  # 0: read the whole answer; k: hang up after k chunks

    @property
    def rid(self) -> str:
        # The router keeps a client's X-Request-ID only when it is a UUID.
        return f"acc0acc0-0000-4000-8000-{self.index:012d}"

    @property
    def stream(self) -> bool:
        return "stream" in self.shape


@dataclass
class Result:
    call: Call
    started: float
    finished: float = 0.0
    status: int = 0  # the HTTP status; 0 when no answer came
    code: str = ""  # the error code of a refusal or of a broken stream
    ended: str = "unreached"  # whole, hangup, broken, refused, unreached
    seen_in: int = 0  # the usage the client was shown, if any
    seen_out: int = 0


def plan(seed: int, count: int, tenants: Sequence[Tenant], routers: int = 3) -> list[Call]:
    rng = random.Random(seed)
    calls = []
    for index in range(count):
        shape = rng.choice(SHAPES)
        tenant = rng.choice(tenants)
        if shape.startswith("messages"):
            max_tokens: int | None = rng.choice((8, 16, 32, 40))
        else:
            max_tokens = None if rng.random() < 0.3 else rng.choice((8, 16, 32, 40))
        n = 2 if not shape.startswith("messages") and rng.random() < 0.15 else 1
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randrange(3, 40)))
        cacheable = rng.random() < 0.15
        if cacheable:  # one of a few bodies of two tenants: repeats, hits and followers
            tenant = tenants[5 + rng.randrange(2)] if len(tenants) > 6 else tenant
            shape = rng.choice(CACHED_SHAPES)
            prompt = f"Repeat after me, cached question number {rng.randrange(2)}."
            max_tokens, n = 16, 1
        streamed = "stream" in shape
        hangup = rng.randrange(2, 6) if streamed and not cacheable and rng.random() < 0.15 else 0
        calls.append(
            Call(
                index=index,
                tenant=tenant,
                router=rng.randrange(routers),
                shape=shape,
                prompt=prompt,
                max_tokens=max_tokens,
                n=n,
                cacheable=cacheable,
                hangup=hangup,
            )
        )
    return calls


def _options(call: Call) -> dict[str, Any]:
    options: dict[str, Any] = {"model": MODEL, "extra_headers": {"X-Request-ID": call.rid}}
    if call.max_tokens is not None:
        options["max_tokens"] = call.max_tokens
    if call.cacheable:
        options["temperature"] = 0
    if call.n > 1:
        options["n"] = call.n
    if call.shape.endswith("_usage"):
        options["stream_options"] = {"include_usage": True}
    if call.stream:
        options["stream"] = True
    return options


def _read(result: Result, stream: Any, hangup: int) -> None:
    """Read a stream to its end (or hang up after `hangup` chunks), noting usage seen."""
    chunks = 0
    try:
        for chunk in stream:
            chunks += 1
            _note_usage(result, chunk)
            if hangup and chunks >= hangup:
                result.ended = "hangup"
                return
        result.ended = "whole"
    finally:
        stream.close()


def _note_usage(result: Result, chunk: Any) -> None:
    usage = getattr(chunk, "usage", None)
    if usage is None and getattr(chunk, "type", "") == "message_start":
        usage = chunk.message.usage
    if usage is None:
        return
    tokens_in = getattr(usage, "prompt_tokens", None) or getattr(usage, "input_tokens", 0)
    tokens_out = getattr(usage, "completion_tokens", None) or getattr(usage, "output_tokens", 0)
    result.seen_in = max(result.seen_in, int(tokens_in or 0))
    result.seen_out = max(result.seen_out, int(tokens_out or 0))


def _send(fleet: Fleet, call: Call, result: Result) -> None:
    url = fleet.routers[call.router].url
    options = _options(call)
    if call.shape.startswith("messages"):
        with anthropic.Anthropic(
            base_url=url, api_key=call.tenant.secret, max_retries=0, timeout=CLIENT_TIMEOUT
        ) as client:
            options.pop("extra_headers")
            answer = client.messages.create(
                messages=[{"role": "user", "content": call.prompt}],
                extra_headers={"X-Request-ID": call.rid},
                **options,
            )
            _finish(result, answer, call)
        return
    with openai.OpenAI(
        base_url=url + "/v1", api_key=call.tenant.secret, max_retries=0, timeout=CLIENT_TIMEOUT
    ) as oai:
        if call.shape.startswith("chat"):
            answer = oai.chat.completions.create(
                messages=[{"role": "user", "content": call.prompt}], **options
            )
        else:
            answer = oai.completions.create(prompt=call.prompt, **options)
        _finish(result, answer, call)


def _finish(result: Result, answer: Any, call: Call) -> None:
    result.status = 200
    if call.stream:
        result.ended = "broken"  # until the stream is read to its end
        _read(result, answer, call.hangup)
    else:
        _note_usage(result, answer)
        result.ended = "whole"


def execute(fleet: Fleet, call: Call) -> Result:
    result = Result(call, time.monotonic())
    try:
        _send(fleet, call, result)
    except (openai.APIStatusError, anthropic.APIStatusError) as error:
        result.status, result.code = error.status_code, _code(error.body)
        result.ended = "refused"
    except Exception as error:  # any other failure is an outcome to record
        # A connection that failed, an error event inside a 200 stream, a body cut short.
        result.code = _code(getattr(error, "body", None)) or type(error).__name__
        if result.status == 200:
            result.ended = "broken"
    result.finished = time.monotonic()
    return result


def _code(body: object) -> str:
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict):
            return str(inner.get("code") or inner.get("type") or "")
    return ""


@dataclass(frozen=True)
class Fault:
    name: str
    start: int  # the request whose taking fires it
    end: int  # requests from this one on wait until it is over
    act: Callable[[], None]


def run(fleet: Fleet, calls: Sequence[Call], faults: Sequence[Fault], workers: int) -> list[Result]:
    """Send `calls` from `workers` threads in order, firing `faults` as they say."""
    results: list[Result | None] = [None] * len(calls)
    fired = [threading.Event() for _ in faults]
    over = [threading.Event() for _ in faults]
    errors: list[BaseException] = []
    taken = iter(range(len(calls)))
    lock = threading.Lock()

    def faulting() -> None:
        for index, fault in enumerate(faults):
            fired[index].wait()
            try:
                fault.act()
            except BaseException as error:  # reported after the run, never swallowed
                errors.append(error)
            finally:
                over[index].set()

    def work() -> None:
        while True:
            with lock:
                index = next(taken, None)
            if index is None:
                return
            for number, fault in enumerate(faults):
                if index >= fault.start:
                    fired[number].set()
                if index >= fault.end:
                    over[number].wait(timeout=120)
            results[index] = execute(fleet, calls[index])

    injector = threading.Thread(target=faulting, name="faults", daemon=True)
    injector.start()
    threads = [threading.Thread(target=work, name=f"client-{i}") for i in range(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for event in fired:
        event.set()  # a fault placed past the last request still runs
    injector.join(timeout=180)
    if errors:
        raise errors[0]
    done = [r for r in results if r is not None]
    assert len(done) == len(calls), f"{len(calls) - len(done)} requests were not sent"
    return done
