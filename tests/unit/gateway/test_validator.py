"""The stream validator stage, with a scripted local answer, a fake dispatch and a fake
provider: what the client is handed, where the request goes after a loop, and that every
local answer is closed exactly once with the outcome it had."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import orjson
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from hivenet_router.clock import ManualClock, run_in_virtual_time
from hivenet_router.domain.answer import Answer, AnswerBroken, Outcome, Whole
from hivenet_router.domain.errors import ApiError, ErrorCode
from hivenet_router.domain.request import Job, Usage
from hivenet_router.gateway.blocks import VALIDATOR
from hivenet_router.gateway.settings import ValidatorSettings
from hivenet_router.gateway.validator import AVOID, REPLACED, StreamValidator
from hivenet_router.observability.events import Observers
from hivenet_router.observability.validator_metrics import ValidatorCollector, ValidatorMetrics
from hivenet_router.pipeline.stage import Next
from hivenet_router.pipeline.ticket import Ticket
from hivenet_router.policy.document import BUILT_IN, Policy, Provider
from hivenet_router.sim.text import Corpus

SETTINGS = ValidatorSettings(hold_chunks=15, min_words=12, min_compression_ratio=0.1)
HEADERS = [("content-type", "text/event-stream")]


def chat(text: str) -> bytes:
    delta = {"choices": [{"index": 0, "delta": {"content": text}}]}
    return b"data: " + orjson.dumps(delta) + b"\n\n"


def anthropic(text: str) -> bytes:
    event = {"type": "content_block_delta", "delta": {"type": "text_delta", "text": text}}
    return b"event: content_block_delta\ndata: " + orjson.dumps(event) + b"\n\n"


END = b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":40}}\n\ndata: [DONE]\n\n'
STOP = b'event: message_stop\ndata: {"type":"message_stop"}\n\n'


def clean(count: int = 40) -> list[bytes]:
    return [chat(token) for token in Corpus(7).answer(b"clean", count)] + [END]


def looping(count: int = 40) -> list[bytes]:
    return [chat((" over", " and")[i % 2]) for i in range(count)] + [END]


class Script:
    """A local answer's source: chunks (or an error to raise) read one at a time, each
    after `delay` seconds."""

    def __init__(self, items: Sequence[bytes | Exception], delay: float = 0.0) -> None:
        self.items = list(items)
        self.delay = delay
        self.reads = 0
        self.closed: list[Outcome] = []

    async def read(self) -> bytes | None:
        self.reads += 1
        if self.delay:
            await asyncio.sleep(self.delay)
        if not self.items:
            return None
        item = self.items.pop(0)
        if isinstance(item, Exception):
            raise item
        return item

    def close(self, outcome: Outcome) -> None:
        self.closed.append(outcome)


class Resets:
    """A local answer's source that behaves like an agent stream: a read waits until data
    comes, and closing resets the stream, so a read still waiting then fails."""

    def __init__(self, items: Sequence[bytes | Exception]) -> None:
        self.items = list(items)
        self.reset = asyncio.Event()
        self.closed: list[Outcome] = []
        self.failed_after_close = 0

    async def read(self) -> bytes | None:
        if self.items:
            item = self.items.pop(0)
            if isinstance(item, Exception):
                raise item
            return item
        await self.reset.wait()
        self.failed_after_close += 1
        raise AnswerBroken(ErrorCode.AGENT_DISCONNECTED, "stream reset")

    def close(self, outcome: Outcome) -> None:
        self.closed.append(outcome)
        self.reset.set()


def loop_errors(loop: asyncio.AbstractEventLoop) -> list[str]:
    """What the loop would log (a task's exception never retrieved, for one)."""
    errors: list[str] = []

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        errors.append(str(context["message"]))

    loop.set_exception_handler(handler)
    return errors


class Local:
    """One local answer as dispatch returns it, with dispatch's close hook recorded."""

    def __init__(self, chunks: Sequence[bytes | Exception], peer: str, delay: float = 0.0) -> None:
        first = chunks[0]
        assert isinstance(first, bytes)
        self.script = Script(chunks[1:], delay)
        self.answer = Answer(200, HEADERS, self.script, first=first, origin=peer)
        self.hooks: list[Outcome] = []
        self.answer.on_close(lambda outcome, usage: self.hooks.append(outcome))
        self.bytes = b"".join(c for c in chunks if isinstance(c, bytes))

    def closed_once(self, outcome: Outcome) -> bool:
        return self.hooks == [outcome] and self.script.closed == [outcome]


class Dispatch:
    """A fake `next`: hands out the prepared answers in order, noting what it was asked."""

    def __init__(self, *answers: Answer | ApiError) -> None:
        self.answers = list(answers)
        self.calls: list[frozenset[str]] = []

    async def __call__(self, ticket: Ticket) -> Answer:
        self.calls.append(ticket.get(AVOID))
        item = self.answers.pop(0)
        if isinstance(item, ApiError):
            raise item
        ticket.origin = item.origin
        return item


class Cloud:
    def __init__(self, result: Answer | ApiError | None = None) -> None:
        self.result = result or Answer(200, HEADERS, Whole(), first=chat(" cloud") + END)
        self.calls = 0

    async def __call__(self, ticket: Ticket) -> Answer:
        self.calls += 1
        if isinstance(self.result, ApiError):
            raise self.result
        ticket.provider, ticket.origin = True, "openai"
        return self.result


def policy(settings: ValidatorSettings | None = SETTINGS, provider: bool = True) -> Policy:
    fallback = Provider("openai", "cloud-model") if provider else None
    return Policy("p", ("m",), BUILT_IN.steps, fallback_provider=fallback).with_block(
        VALIDATOR, settings
    )


def ticket(stream: bool = True) -> Ticket:
    t = Ticket("rid", "/v1/chat/completions", 0.0, Observers())
    t.job = Job("/v1/chat/completions", "m", "llm", stream, b"{}", [])
    return t


class Validator(StreamValidator):
    """The stage as a request meets it: with the model's policy already on the ticket (the
    handlers resolve it before the first stage)."""

    def __init__(self, policy: Policy, *args: Any) -> None:
        super().__init__(*args)
        self.policy = policy

    async def __call__(self, ticket: Ticket, next: Next) -> Answer:
        ticket.policy = self.policy
        return await super().__call__(ticket, next)


def stage(p: Policy, cloud: Callable[[Ticket], Awaitable[Answer]]) -> StreamValidator:
    return Validator(p, cloud, ValidatorMetrics())


async def relay(answer: Answer) -> tuple[bytes, Outcome]:
    """Write the answer as the relay does: all of it, then close it once."""
    out, outcome = [], Outcome.CLIENT_GONE
    try:
        chunk = answer.first
        while chunk is not None:
            out.append(chunk)
            chunk = await answer.next_chunk()
        outcome = Outcome.OK
    except AnswerBroken:
        outcome = Outcome.BROKEN
    finally:
        await answer.close(outcome)
    return b"".join(out), outcome


def count(validator: StreamValidator, name: str, *labels: str) -> float:
    series = getattr(validator.metrics, name)
    return float(series.values[labels][0])


# -- nothing to do -------------------------------------------------------------------------


async def test_a_policy_without_the_block_passes_through() -> None:
    local = Local(looping(), "peer-a")
    validator = stage(policy(settings=None), Cloud())
    assert await validator(ticket(), Dispatch(local.answer)) is local.answer
    assert local.script.reads == 0


async def test_a_provider_answer_or_an_error_is_not_judged() -> None:
    cloud_answer = Answer(200, HEADERS, Script(looping()[1:]), first=looping()[0])

    async def via_provider(t: Ticket) -> Answer:
        t.provider = True
        return cloud_answer

    validator = stage(policy(), Cloud())
    assert await validator(ticket(), via_provider) is cloud_answer
    refused = Answer(429, [], Whole(), body=b'{"error":{}}')
    assert await validator(ticket(), Dispatch(refused)) is refused


# -- clean streams ---------------------------------------------------------------------------


async def test_a_clean_stream_is_held_by_chunks_then_relayed_byte_for_byte() -> None:
    local = Local(clean(), "peer-a")
    validator = stage(policy(), Cloud())
    t = ticket()
    answer = await validator(t, Dispatch(local.answer))
    assert answer is not local.answer and answer.status == 200 and answer.headers == HEADERS
    assert answer.first == b"".join(clean()[:15])  # the held window, as one chunk
    assert local.script.reads == 14  # nothing read past the window before the client asks
    body, outcome = await relay(answer)
    assert body == local.bytes and outcome is Outcome.OK
    assert local.closed_once(Outcome.OK)
    assert answer.usage == Usage(3, 40) and t.noted(REPLACED) is None
    assert count(validator, "streams", "clean") == 1
    assert validator.metrics.hold.values[()][-1] >= 0  # one hold observed
    assert sum(validator.metrics.hold.values[()][:-1]) == 1


def test_a_slow_stream_is_held_for_hold_ms_and_loses_no_chunk() -> None:
    async def main() -> None:
        local = Local(clean(), "peer-a", delay=0.1)
        settings = ValidatorSettings(hold_chunks=100, hold_ms=250, min_words=12)
        validator = stage(policy(settings), Cloud())
        loop = asyncio.get_running_loop()
        started = loop.time()
        answer = await validator(ticket(), Dispatch(local.answer))
        assert loop.time() - started == pytest.approx(0.25)
        assert answer.first == b"".join(clean()[:3])  # the first, then two in 0.25 s
        body, outcome = await relay(answer)  # the read the window cut short is not lost
        assert body == local.bytes and outcome is Outcome.OK
        assert local.closed_once(Outcome.OK)

    run_in_virtual_time(ManualClock(), main())


def test_the_hold_ends_at_the_deadline() -> None:
    async def main() -> None:
        local = Local(clean(), "peer-a", delay=0.1)
        settings = ValidatorSettings(hold_chunks=100, hold_ms=5000, min_words=12)
        t = ticket()
        loop = asyncio.get_running_loop()
        t.deadline = loop.time() + 0.35
        answer = await stage(policy(settings), Cloud())(t, Dispatch(local.answer))
        assert loop.time() == pytest.approx(t.deadline)
        await relay(answer)
        assert local.closed_once(Outcome.OK)

    run_in_virtual_time(ManualClock(), main())


async def test_a_short_stream_held_whole() -> None:
    local = Local(clean(5), "peer-a")
    answer = await stage(policy(), Cloud())(ticket(), Dispatch(local.answer))
    assert answer.first == local.bytes
    assert await answer.next_chunk() is None
    assert local.script.reads == 6  # five chunks and the end, and none after it
    await answer.close(Outcome.OK)
    assert local.closed_once(Outcome.OK)


# -- loops within the hold -------------------------------------------------------------------


async def test_a_loop_goes_to_the_provider() -> None:
    local = Local(looping(), "peer-a")
    cloud = Cloud()
    validator = stage(policy(), cloud)
    t = ticket()
    dispatch = Dispatch(local.answer)
    answer = await validator(t, dispatch)
    assert answer is cloud.result and cloud.calls == 1 and len(dispatch.calls) == 1
    assert local.closed_once(Outcome.BROKEN)  # the engine's stream reset, a failure
    assert local.script.reads < 14  # the verdict came before the window was full
    assert t.noted(REPLACED) == "degenerate" and t.agent is None and t.origin == "openai"
    assert count(validator, "streams", "degenerate") == 1
    assert count(validator, "fallbacks", "provider", "ok") == 1
    body, _ = await relay(answer)
    assert b"over" not in body


async def test_without_a_provider_another_agent_serves() -> None:
    bad, good = Local(looping(), "peer-a"), Local(clean(), "peer-b")
    validator = stage(policy(provider=False), Cloud())
    t = ticket()
    dispatch = Dispatch(bad.answer, good.answer)
    answer = await validator(t, dispatch)
    assert dispatch.calls == [frozenset(), frozenset({"peer-a"})]
    assert bad.closed_once(Outcome.BROKEN) and good.hooks == []
    body, outcome = await relay(answer)
    assert body == good.bytes and outcome is Outcome.OK
    assert good.closed_once(Outcome.OK)
    assert t.noted(REPLACED) == "degenerate" and t.origin == "peer-b"
    assert count(validator, "fallbacks", "agent", "ok") == 1


async def test_a_second_loop_has_no_third_try() -> None:
    first, second = Local(looping(), "peer-a"), Local(looping(), "peer-b")
    dispatch = Dispatch(first.answer, second.answer)
    with pytest.raises(ApiError) as caught:
        await stage(policy(provider=False), Cloud())(ticket(), dispatch)
    assert caught.value.code is ErrorCode.DEGENERATE_OUTPUT
    assert first.closed_once(Outcome.BROKEN) and second.closed_once(Outcome.BROKEN)
    assert len(dispatch.calls) == 2


async def test_a_replacement_rejected_too_counts_as_a_failed_fallback() -> None:
    validator = stage(policy(provider=False), Cloud())
    dispatch = Dispatch(Local(looping(), "peer-a").answer, Local(looping(), "peer-b").answer)
    with pytest.raises(ApiError):
        await validator(ticket(), dispatch)
    assert count(validator, "fallbacks", "agent", "ok") == 0
    assert count(validator, "fallbacks", "agent", "error") == 1


async def test_no_other_agent_is_a_degenerate_output_error() -> None:
    local = Local(looping(), "peer-a")
    refusal = ApiError(ErrorCode.NO_AGENTS_AVAILABLE, "none")
    validator = stage(policy(provider=False), Cloud())
    with pytest.raises(ApiError) as caught:
        await validator(ticket(), Dispatch(local.answer, refusal))
    assert caught.value.code is ErrorCode.DEGENERATE_OUTPUT
    assert count(validator, "fallbacks", "agent", "error") == 1
    timeout = ApiError(ErrorCode.REQUEST_TIMEOUT, "late")
    with pytest.raises(ApiError) as caught:
        await validator(ticket(), Dispatch(Local(looping(), "peer-a").answer, timeout))
    assert caught.value.code is ErrorCode.REQUEST_TIMEOUT  # other errors stand


async def test_a_failing_provider_is_the_clients_error() -> None:
    local = Local(looping(), "peer-a")
    validator = stage(policy(), Cloud(ApiError(ErrorCode.BACKEND_ERROR, "down")))
    with pytest.raises(ApiError) as caught:
        await validator(ticket(), Dispatch(local.answer))
    assert caught.value.code is ErrorCode.BACKEND_ERROR
    assert local.closed_once(Outcome.BROKEN)
    assert count(validator, "fallbacks", "provider", "error") == 1


async def test_a_degenerate_whole_answer_is_replaced_too() -> None:
    text = " over and" * 30
    body = orjson.dumps({"choices": [{"index": 0, "message": {"content": text}}]})
    whole = Answer(200, [], Whole(), body=body, origin="peer-a")
    hooks: list[Outcome] = []
    whole.on_close(lambda outcome, usage: hooks.append(outcome))
    cloud = Cloud(Answer(200, [], Whole(), body=b'{"choices":[]}'))
    answer = await stage(policy(), cloud)(ticket(stream=False), Dispatch(whole))
    assert answer is cloud.result and hooks == [Outcome.BROKEN]
    sound = Answer(200, [], Whole(), body=orjson.dumps({"choices": [{"text": " fine"}]}))
    assert await stage(policy(), cloud)(ticket(stream=False), Dispatch(sound)) is sound


async def test_an_anthropic_loop_is_seen() -> None:
    start = b'event: message_start\ndata: {"type":"message_start","message":{}}\n\n'
    local = Local([start] + [anthropic((" over", " and")[i % 2]) for i in range(30)], "peer-a")
    cloud = Cloud()
    assert await stage(policy(), cloud)(ticket(), Dispatch(local.answer)) is cloud.result


@pytest.mark.parametrize("failing", [False, True], ids=["read_waiting", "read_failed"])
def test_a_loop_judged_as_the_window_closes_drops_the_read_in_flight(failing: bool) -> None:
    """The window ends (hold_ms, or a failed read) with a read in flight, and the last
    judgement finds a loop: that read is dropped before the local answer is closed, so it
    neither runs on against the reset stream nor leaves an error nobody takes."""

    async def main() -> None:
        errors = loop_errors(asyncio.get_running_loop())
        # Two words in turn: no n-gram limit, only the deflate at the window's end sees it.
        settings = ValidatorSettings(
            hold_chunks=100, hold_ms=200, max_repeat_fraction=1.0, min_compression_ratio=0.5
        )
        items: list[bytes | Exception] = [chat((" bbb", " aaa")[i % 2]) for i in range(13)]
        if failing:
            items.append(AnswerBroken(ErrorCode.AGENT_DISCONNECTED, "gone"))
        source = Resets(items)
        local = Answer(200, HEADERS, source, first=chat(" aaa"), origin="peer-a")
        cloud = Cloud()
        validator = stage(policy(settings), cloud)
        answer = await validator(ticket(), Dispatch(local))
        assert answer is cloud.result and source.closed == [Outcome.BROKEN]
        assert count(validator, "streams", "degenerate") == 1
        await asyncio.sleep(1)
        gc.collect()
        await asyncio.sleep(0)
        assert source.failed_after_close == 0
        assert errors == []

    run_in_virtual_time(ManualClock(), main())


# -- after the hold --------------------------------------------------------------------------


async def test_a_late_loop_ends_the_stream_with_an_error() -> None:
    chunks = clean(30)[:-1] + looping(60)
    local = Local(chunks, "peer-a")
    validator = stage(policy(), Cloud())
    answer = await validator(ticket(), Dispatch(local.answer))
    sent = [answer.first]
    with pytest.raises(AnswerBroken) as caught:  # what the relay turns into the envelope
        while (chunk := await answer.next_chunk()) is not None:
            sent.append(chunk)
    assert caught.value.code is ErrorCode.DEGENERATE_OUTPUT
    # Within the window's reach: 30 clean words, then some 46 of the loop's 60.
    assert 10 < b"".join(c for c in sent if c).count(b"over") < 30
    await answer.close(Outcome.BROKEN)
    assert local.closed_once(Outcome.BROKEN)
    assert count(validator, "streams", "late_degenerate") == 1
    assert count(validator, "streams", "clean") == 0


def two_words(count: int, event: Callable[[str], bytes] = chat) -> list[bytes]:
    """A loop only the last deflate sees, with the settings below: `count` words of two in
    turn, too few for a deflate on the way (every 16 words)."""
    return [event((" aaa", " bbb")[i % 2]) for i in range(count)]


LATE = ValidatorSettings(hold_chunks=2, max_repeat_fraction=1.0, min_compression_ratio=0.5)


@pytest.mark.parametrize("shape", ["openai", "anthropic"])
async def test_a_verdict_after_the_terminal_event_is_only_counted(shape: str) -> None:
    """The last judgement comes when the answer is complete: the client has every byte,
    [DONE] (or message_stop) included, so the stream ends as it is; the loop shows in the
    metrics only."""
    event, end = (chat, END) if shape == "openai" else (anthropic, STOP)
    local = Local([*two_words(14, event), end], "peer-a")
    validator = stage(policy(LATE), Cloud())
    answer = await validator(ticket(), Dispatch(local.answer))
    body, outcome = await relay(answer)
    assert outcome is Outcome.OK and body == local.bytes
    assert local.closed_once(Outcome.OK)
    assert count(validator, "streams", "late_degenerate") == 1
    assert count(validator, "streams", "clean") == 0
    assert not answer.keep  # a cache must not serve it to anyone else


async def test_an_end_without_a_terminal_event_still_breaks() -> None:
    """No [DONE] came: the client has no complete answer, and a loop ends it with the error."""
    local = Local(two_words(14), "peer-a")
    validator = stage(policy(LATE), Cloud())
    body, outcome = await relay(await validator(ticket(), Dispatch(local.answer)))
    assert outcome is Outcome.BROKEN and body == local.bytes
    assert local.closed_once(Outcome.BROKEN)
    assert count(validator, "streams", "late_degenerate") == 1


async def test_a_loop_in_the_terminal_chunk_holds_it_back() -> None:
    """A chunk whose own text is the loop is not sent, even the one that carries [DONE]."""
    last = b"".join(chat((" over", " and")[i % 2]) for i in range(60)) + END
    local = Local([*clean(20)[:-1], last], "peer-a")
    validator = stage(policy(ValidatorSettings(hold_chunks=2)), Cloud())
    body, outcome = await relay(await validator(ticket(), Dispatch(local.answer)))
    assert outcome is Outcome.BROKEN and b"over" not in body and b"[DONE]" not in body
    assert local.closed_once(Outcome.BROKEN)


async def test_the_hold_ends_at_the_terminal_event() -> None:
    """A window that reaches [DONE] judges the complete text, where a loop is still
    replaced, and then waits for nothing more."""
    local = Local([*two_words(14), END], "peer-a")
    cloud = Cloud()
    settings = ValidatorSettings(
        hold_chunks=100, max_repeat_fraction=1.0, min_compression_ratio=0.5
    )
    answer = await stage(policy(settings), cloud)(ticket(), Dispatch(local.answer))
    assert answer is cloud.result and local.closed_once(Outcome.BROKEN)
    assert local.script.reads == 14  # the chunk with [DONE] was the last one read


async def test_after_hold_off_lets_a_late_loop_through() -> None:
    local = Local(clean(30)[:-1] + looping(60), "peer-a")
    settings = ValidatorSettings(hold_chunks=15, min_words=12, after_hold=False)
    answer = await stage(policy(settings), Cloud())(ticket(), Dispatch(local.answer))
    body, outcome = await relay(answer)
    assert outcome is Outcome.OK and body == local.bytes


async def test_a_stream_that_breaks_in_the_hold_breaks_in_order() -> None:
    broken = AnswerBroken(ErrorCode.AGENT_DISCONNECTED, "gone")
    local = Local([*clean(4)[:-1], broken], "peer-a")
    answer = await stage(policy(), Cloud())(ticket(), Dispatch(local.answer))
    assert answer.first == b"".join(clean(4)[:-1])
    with pytest.raises(AnswerBroken):
        await answer.next_chunk()
    await answer.close(Outcome.BROKEN)
    assert local.closed_once(Outcome.BROKEN)


# -- the client goes away --------------------------------------------------------------------


def test_a_client_gone_during_the_hold_closes_the_local_answer_once() -> None:
    async def main() -> None:
        local = Local(clean(), "peer-a", delay=0.1)
        settings = ValidatorSettings(hold_chunks=100, hold_ms=5000, min_words=12)
        task = asyncio.ensure_future(
            stage(policy(settings), Cloud())(ticket(), Dispatch(local.answer))
        )
        await asyncio.sleep(0.25)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert local.closed_once(Outcome.CLIENT_GONE)
        await asyncio.sleep(1)  # the cancelled read settles quietly

    run_in_virtual_time(ManualClock(), main())


def test_a_client_gone_after_the_hold_closes_the_local_answer_once() -> None:
    async def main() -> None:
        local = Local(clean(), "peer-a", delay=0.1)
        settings = ValidatorSettings(hold_chunks=100, hold_ms=250, min_words=12)
        answer = await stage(policy(settings), Cloud())(ticket(), Dispatch(local.answer))
        await answer.next_chunk()
        await answer.close(Outcome.CLIENT_GONE)  # with the window's cut read still pending
        await answer.close(Outcome.OK)  # a second close changes nothing
        assert local.closed_once(Outcome.CLIENT_GONE)
        await asyncio.sleep(1)

    run_in_virtual_time(ManualClock(), main())


def test_the_metrics_page() -> None:
    metrics = ValidatorMetrics()
    metrics.judged("degenerate")
    metrics.fell_back("provider", True)
    metrics.held(0.03)
    registry = CollectorRegistry()
    registry.register(ValidatorCollector(metrics))
    page = generate_latest(registry).decode()
    assert 'hivenet_validator_streams_total{result="degenerate"} 1.0' in page
    assert 'hivenet_validator_streams_total{result="clean"} 0.0' in page  # there from the start
    assert 'hivenet_validator_fallbacks_total{result="ok",to="provider"} 1.0' in page
    assert 'hivenet_validator_fallbacks_total{result="error",to="agent"} 0.0' in page
    assert 'hivenet_validator_hold_seconds_bucket{le="0.05"} 1.0' in page
    assert "hivenet_validator_hold_seconds_count 1.0" in page
