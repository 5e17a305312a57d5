"""The stream-quality validator: a local engine's answer is checked for degenerate output
(a model stuck repeating itself) and, where the request asks for structure, for broken
syntax (`syntax.SyntaxJudge`: JSON that can no longer become valid, tool-call arguments or
a value that do not fit their schema, events that are not SSE/JSON) before the client sees
it, and replaced when it fails. A syntax failure is handled as a loop is, below; the audit
record says which (`replaced`) and why (`replaced_reason`); a late one ends the stream with
`malformed_output`.

For a policy with a `stream_validator` block, the first chunks of a local stream are held
back (up to `hold_chunks` chunks or `hold_ms`, never past the stream's end) and their
text judged (`degenerate.Detector`). Clean: the held chunks go out as one first chunk and
the rest flows through unbuffered, still watched when `after_hold` is on: a loop found in a
later chunk ends the stream, that chunk unsent, with the `degenerate_output` error event
(AnswerBroken). The last judgement, when the terminal event arrives, is only counted: the
client then holds every word. Degenerate within the hold: the local answer is closed as
broken (its stream is reset, so the engine stops generating, and routing counts a failure
of that agent), and the request goes to the policy's fallback provider, or, when the policy
has none, once more through dispatch with the failed agent avoided. The client receives one
clean stream or one error: nothing of the rejected attempt was sent. A whole (non-streamed)
answer is judged the same way, at no cost in latency. Provider answers are not judged; a
second local answer is, with no third try.

This stage calls `next` twice on the agent path (the one exception to the pipeline's
"at most once"): the first answer is closed, and everything dispatch took for it given back,
before the second call. Stages before this one see only the answer the client gets, so the
rejected attempt is neither metered nor billed: its usage never reaches their close hooks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Final, NamedTuple

import orjson

from hivenet_router.domain.answer import Answer, AnswerBroken, Outcome
from hivenet_router.domain.errors import ApiError, ErrorCode
from hivenet_router.domain.request import Job, Usage
from hivenet_router.gateway.blocks import VALIDATOR
from hivenet_router.gateway.degenerate import Detector, judge
from hivenet_router.gateway.settings import ValidatorSettings
from hivenet_router.gateway.sse_text import SseText, value_text
from hivenet_router.gateway.syntax import Asked, SyntaxJudge, asked
from hivenet_router.observability.validator_metrics import ValidatorMetrics
from hivenet_router.pipeline.stage import Next
from hivenet_router.pipeline.ticket import Key, Note, Ticket
from hivenet_router.policy.document import Policy

Fallback = Callable[[Ticket], Awaitable[Answer]]
Read = asyncio.Future[bytes | None]

# Agents dispatch skips for this request: peer IDs whose answer to it already looped.
# Dispatch reads it (it cannot be declared there: the gateway stands below the router).
AVOID: Final = Key[frozenset[str]]("avoid", frozenset)
# Why the local answer was replaced, on the audit record: "degenerate" or "syntax", and
# the check's own words ("repeated_ngrams", "json: the answer is no JSON from character 9").
REPLACED: Final = Note[str]("replaced", place=40)
REPLACED_REASON: Final = Note[str]("replaced_reason", place=41)


class Failure(NamedTuple):
    """Why a local answer is rejected."""

    kind: str  # "degenerate" or "syntax"
    reason: str
    check: str | None = None  # the syntax check that failed (syntax.CHECKS)


def _judge_for(form: Asked | None, settings: ValidatorSettings) -> SyntaxJudge | None:
    """A fresh syntax judge for one local answer; None when no check applies to it."""
    if form is None:
        return None
    judge = SyntaxJudge(form, settings.syntax)
    return judge if judge.active else None


def _form(job: Job, settings: ValidatorSettings) -> Asked | None:
    """What the request asks of the answer's form; None when no syntax check is on."""
    if not settings.syntax.any:
        return None
    return asked(job.route, job.body)


class StreamValidator:
    name = "validator"

    def __init__(self, provider: Fallback, metrics: ValidatorMetrics | None = None) -> None:
        self.provider = provider  # the policy's cloud provider for this ticket
        self.metrics = metrics if metrics is not None else ValidatorMetrics()

    async def __call__(self, ticket: Ticket, next: Next) -> Answer:
        job = ticket.job
        if job is None or job.capability != "llm":
            return await next(ticket)
        policy = ticket.policy
        settings = policy.block(VALIDATOR)
        if settings is None:
            return await next(ticket)
        form = _form(job, settings)
        answer = await next(ticket)
        return await self._judge(ticket, next, (policy, settings, form), answer, retry=True)

    async def _judge(
        self, ticket: Ticket, next: Next, rules: Rules, answer: Answer, retry: bool
    ) -> Answer:
        if ticket.provider or answer.status >= 400:
            return answer  # a provider's answer, or an error: nothing to judge
        settings = rules[1]
        syntax = _judge_for(rules[2], settings)
        if answer.body is not None:
            failure = _whole(answer.body, settings, syntax)
            if failure is None:
                self.metrics.judged("clean")
                return answer
        else:
            hold = Hold(answer, settings, syntax)
            await self._hold(ticket, hold, settings)
            failure = hold.failure()
            if failure is None:
                return self._release(hold, settings)
            # A read the window closed on must not outlive the answer: closing resets the
            # stream, and the read would fail with nobody to take its error.
            hold.discard()
        self.metrics.judged(failure.kind, failure.check)
        await answer.close(Outcome.BROKEN)  # resets the engine's stream; the agent failed
        return await self._replace(ticket, next, rules, failure, answer.origin, retry)

    async def _hold(self, ticket: Ticket, hold: Hold, settings: ValidatorSettings) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        until = started + settings.hold_ms / 1000
        end = ticket.stream_end or ticket.deadline  # the head is in: the stream's bound
        if end:
            until = min(until, end)
        try:
            await hold.fill(settings.hold_chunks, until, loop)
        except BaseException as exc:
            # The client went away (or the router is stopping) while the answer was held:
            # nothing was sent, and the answer is closed here as nobody else has it.
            hold.discard()
            gone = isinstance(exc, asyncio.CancelledError)
            await hold.answer.close(Outcome.CLIENT_GONE if gone else Outcome.BROKEN)
            raise
        self.metrics.held(loop.time() - started)

    def _release(self, hold: Hold, settings: ValidatorSettings) -> Answer:
        """The clean answer: the held chunks as its first chunk, then the rest of the local
        answer. Closing it closes the local answer once, with the same outcome."""
        local = hold.answer
        # Nothing is left to judge once the end, or the terminal event, was in the window.
        done = hold.ended or hold.text.done
        watch = settings.after_hold and not done
        source = Checked(local, hold.pending, hold.text, hold.ended)
        if watch:
            source.watch(hold.detector, hold.syntax)
        hold.pending = None
        first = b"".join(hold.chunks) if hold.chunks else None
        outer = Answer(local.status, local.headers, source, first=first, origin=local.origin)
        if local.expects_usage:
            outer.expect_usage(*local.event_counting)
        source.outer = outer
        metrics = self.metrics

        async def close_local(outcome: Outcome, usage: Usage | None) -> None:
            if source.broken is not None:
                metrics.judged("late_syntax", source.broken)
            else:
                metrics.judged("late_degenerate" if source.looped else "clean")
            await local.close(outcome)

        outer.on_close(close_local)  # registered first, so it runs after the outer stages'
        return outer

    async def _replace(
        self,
        ticket: Ticket,
        next: Next,
        rules: Rules,
        failure: Failure,
        failed: str,
        retry: bool,
    ) -> Answer:
        """Another answer for a request whose local answer was degenerate or malformed."""
        ticket.note(REPLACED, failure.kind)
        ticket.note(REPLACED_REASON, failure.reason)
        ticket.agent, ticket.origin = None, ""  # the failed agent answered nothing
        if rules[0].fallback_provider is not None:
            return await self._to_provider(ticket)
        code, what = _FAILED[failure.kind]
        if not retry:
            raise ApiError(code, f"the model's answer {what} on two agents")
        ticket.put(AVOID, ticket.get(AVOID) | {failed})
        try:
            answer = await next(ticket)
        except ApiError as exc:
            self.metrics.fell_back("agent", False)
            if exc.code is ErrorCode.NO_AGENTS_AVAILABLE:
                raise ApiError(
                    code, f"the model's answer {what} and no other agent can take the request"
                ) from None
            raise
        try:
            judged = await self._judge(ticket, next, rules, answer, retry=False)
        except ApiError:
            # The other agent's answer was rejected too: the fallback did not help.
            self.metrics.fell_back("agent", False)
            raise
        self.metrics.fell_back("agent", True)
        return judged

    async def _to_provider(self, ticket: Ticket) -> Answer:
        try:
            answer = await self.provider(ticket)
        except ApiError:
            self.metrics.fell_back("provider", False)
            raise
        self.metrics.fell_back("provider", True)
        return answer


# The policy, its validator settings, and what the request asks of the answer's form.
Rules = tuple[Policy, ValidatorSettings, Asked | None]
_FAILED: Final = {
    "degenerate": (ErrorCode.DEGENERATE_OUTPUT, "degenerated into repetition"),
    "syntax": (ErrorCode.MALFORMED_OUTPUT, "was malformed"),
}


def _whole(body: bytes, settings: ValidatorSettings, syntax: SyntaxJudge | None) -> Failure | None:
    """The verdict on a whole answer: its text for loops, its body for syntax."""
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError:
        value = None
    reason = judge(value_text(value), settings)
    if reason is not None:
        return Failure("degenerate", reason)
    if syntax is None:
        return None
    if value is None:
        syntax.bad("a body that is no JSON")
    else:
        syntax.body(value)
    return None if syntax.reason is None else Failure("syntax", syntax.reason, syntax.check)


class Hold:
    """A local stream's first chunks, held back while their text is judged."""

    __slots__ = ("answer", "chunks", "detector", "ended", "pending", "syntax", "text")

    def __init__(
        self, answer: Answer, settings: ValidatorSettings, syntax: SyntaxJudge | None = None
    ) -> None:
        self.answer = answer
        self.detector = Detector(settings)
        self.syntax = syntax
        self.text = SseText(syntax)
        self.chunks: list[bytes] = []
        # A read the window closed on: it carries on, and the released answer takes it.
        # (A source's read may not survive being cancelled: the agent stream's does not.)
        self.pending: Read | None = None
        self.ended = answer.first is None

    def take(self, chunk: bytes) -> None:
        self.chunks.append(chunk)
        self.detector.feed_all(self.text.feed(chunk))

    @property
    def failed(self) -> bool:
        return self.detector.degenerate or (self.syntax is not None and bool(self.syntax.reason))

    def failure(self) -> Failure | None:
        if self.detector.reason is not None:
            return Failure("degenerate", self.detector.reason)
        syntax = self.syntax
        if syntax is not None and syntax.reason is not None:
            return Failure("syntax", syntax.reason, syntax.check)
        return None

    async def fill(self, count: int, until: float, loop: asyncio.AbstractEventLoop) -> None:
        """Read until `count` chunks, the loop time `until`, the end or the terminal event,
        a failed read (it is raised in order, from the released answer), or a verdict of
        degenerate or malformed."""
        answer, detector, text = self.answer, self.detector, self.text
        if answer.first is not None:
            self.take(answer.first)
        while not self.ended and not text.done and len(self.chunks) < count and not self.failed:
            remaining = until - loop.time()
            if remaining <= 0:
                break
            read = self.pending
            if read is None:
                read = self.pending = asyncio.ensure_future(answer.next_chunk())
            done, _ = await asyncio.wait((read,), timeout=remaining)
            if not done or read.cancelled() or read.exception() is not None:
                break
            self.pending = None
            chunk = read.result()
            if chunk is None:
                self.ended = True
            else:
                self.take(chunk)
        if self.ended or text.done:
            detector.finish()  # the text is complete: the final verdict, while it can replace
            if self.syntax is not None and not detector.degenerate:
                self.syntax.finish()
        else:
            detector.settle()

    def discard(self) -> None:
        if self.pending is not None:
            _discard(self.pending)
            self.pending = None


class Checked:
    """The rest of a local answer after its held window, watched for a late loop or a late
    syntax failure.

    A failure found in a chunk ends the stream before that chunk goes out. Once the
    answer's terminal event has come, the text is complete and judged a last time: a loop
    then is only counted (the client has a whole answer, which an error event would spoil,
    and the agent did finish it), but broken syntax still ends the stream with the error:
    a document that does not parse is no answer, and its last chunk is withheld."""

    __slots__ = (
        "_detector",
        "_ended",
        "_local",
        "_pending",
        "_syntax",
        "_text",
        "broken",
        "looped",
        "outer",
    )

    def __init__(self, local: Answer, pending: Read | None, text: SseText, ended: bool) -> None:
        self._local = local
        self._pending = pending
        self._text = text
        self._detector: Detector | None = None
        self._syntax: SyntaxJudge | None = None
        self._ended = ended
        self.looped = False
        self.broken: str | None = None  # the syntax check that failed late
        self.outer: Answer | None = None  # the answer this source feeds

    def watch(self, detector: Detector, syntax: SyntaxJudge | None) -> None:
        self._detector, self._syntax = detector, syntax

    async def read(self) -> bytes | None:
        if self._ended:
            return None
        pending, self._pending = self._pending, None
        chunk = await pending if pending is not None else await self._local.next_chunk()
        detector, syntax = self._detector, self._syntax
        if detector is None:
            self._ended = chunk is None
            return chunk
        if chunk is None:
            # An end without a terminal event: the client has no complete answer yet.
            self._ended, self._detector, self._syntax = True, None, None
            if detector.finish() is not None:
                self._loop(detector)
            if syntax is not None and syntax.finish() is not None:
                self._malformed(syntax)
            return None
        text = self._text
        if detector.feed_all(text.feed(chunk)) is not None:
            self._loop(detector)
        if syntax is not None:
            if text.done:
                syntax.finish()
            if syntax.reason is not None:
                self._malformed(syntax)
        if text.done:
            self._detector, self._syntax = None, None
            self.looped = detector.finish() is not None
            if self.looped and self.outer is not None:
                self.outer.keep = False  # this client keeps it; nobody is served it again
        return chunk

    def _loop(self, detector: Detector) -> None:
        self.looped, self._detector, self._syntax = True, None, None
        raise AnswerBroken(
            ErrorCode.DEGENERATE_OUTPUT,
            f"the model's answer degenerated into repetition ({detector.reason})",
        )

    def _malformed(self, syntax: SyntaxJudge) -> None:
        self.broken, self._detector, self._syntax = syntax.check or "", None, None
        raise AnswerBroken(
            ErrorCode.MALFORMED_OUTPUT, f"the model's answer is malformed ({syntax.reason})"
        )

    def close(self, outcome: Outcome) -> None:
        # The local answer itself is closed by the released answer's close hook (it may
        # need to await); here only a read still in flight is dropped.
        if self._pending is not None:
            _discard(self._pending)
            self._pending = None


def _discard(read: Read) -> None:
    """Drop a read nobody will await: cancel it, and take its outcome when it has one, so
    no 'exception was never retrieved' is logged for it."""
    if not read.done():
        read.cancel()
    read.add_done_callback(_taken)


def _taken(read: Read) -> None:
    if not read.cancelled():
        read.exception()
