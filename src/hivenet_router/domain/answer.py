"""An answer on its way back to the client, and how it ends.

Whoever produced the answer (an agent stream, a provider, a whole body) hands over an
`AnswerSource`. The relay reads it and closes it exactly once with the outcome; closing runs
the hooks of every stage that held something for this request, last taken first, so a
stream keeps what it holds until its last byte. Reading meters token usage on the way:
stages see the answer's usage when it closes, the one count every sink reads (the daily
budget, the wallet, the token rates, the audit record, tenant and agent series). It is what
the answer reported, or, for an answer that reported no output count, the input estimate
the relay set and the output counted from its text (`usage_estimated`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from enum import StrEnum
from typing import Protocol

from hivenet_router.domain.errors import ErrorCode
from hivenet_router.domain.request import Usage
from hivenet_router.domain.usage import (
    OUTPUT_BYTES_PER_TOKEN,
    StreamMeter,
    TextMeter,
    body_text_bytes,
    from_body,
)

log = logging.getLogger("hivenet.router")


class Outcome(StrEnum):
    OK = "ok"  # the whole answer reached the client (an engine's 4xx included)
    CLIENT_GONE = "client_gone"  # the client went away first
    BROKEN = "broken"  # the answer's source failed part-way
    TIMEOUT = "timeout"  # the request's deadline passed part-way


class AnswerBroken(Exception):
    """The source failed after the answer began. Replaces the transport's own errors above
    the dispatch layer; `code` is what the client is told."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class AnswerSource(Protocol):
    """The rest of an answer: read until None, then closed once."""

    async def read(self) -> bytes | None:
        """The next chunk, or None at the end. Raises AnswerBroken."""
        ...

    def close(self, outcome: Outcome) -> None:
        """Give back what the answer holds (a stream, slots). Called exactly once."""
        ...


class Whole:
    """The source of an answer that arrived in one piece: nothing more to read."""

    def __init__(self, on_close: Callable[[Outcome], None] | None = None) -> None:
        self._on_close = on_close

    async def read(self) -> bytes | None:
        return None

    def close(self, outcome: Outcome) -> None:
        if self._on_close is not None:
            self._on_close(outcome)


Meter = Callable[[bytes], None]
# A close hook may be a coroutine function (a shared counter's settlement): `close` awaits it.
Closer = Callable[[Outcome, Usage | None], Awaitable[None] | None]


class Answer:
    """An answer's head, its first chunk (or whole body), and the source of the rest.

    `close` settles it once: it works out the usage the answer reported, closes the source
    and runs the close hooks, last registered first, each shielded from the others' errors.
    """

    __slots__ = (
        "_chunk_hooks",
        "_closed",
        "_closers",
        "_meter",
        "_reported",
        "_text",
        "_unfed",
        "body",
        "first",
        "headers",
        "input_estimate",
        "keep",
        "origin",
        "source",
        "status",
        "usage",
        "usage_estimated",
    )

    def __init__(
        self,
        status: int,
        headers: list[tuple[str, str]],
        source: AnswerSource,
        *,
        body: bytes | None = None,
        first: bytes | None = None,
        origin: str = "",
    ) -> None:
        self.status = status
        self.headers = headers
        self.source = source
        self.body = body  # a whole answer; None for a stream
        self.first = first  # a stream's first chunk
        self.origin = origin  # the agent's peer ID or the provider's name
        # False once a stage judged the answer unfit to be served again (a cache must not
        # store it), though this client gets it whole.
        self.keep = True
        self.usage: Usage | None = None
        self.usage_estimated = False  # counted from the text, not reported
        # Input tokens counted for a stream that reports no usage (set by the relay).
        self.input_estimate = 0
        self._meter: StreamMeter | None = None
        # The usage a reader of the stream already found in it (`read_usage`).
        self._reported: tuple[int | None, int | None] | None = None
        # The text count, for a stream whose usage is not expected (`expect_usage`); the
        # first chunk is fed to it with the second, so a stream found to report its usage
        # before then never pays for a scan.
        self._text: TextMeter | None = None
        self._unfed: bytes | None = None
        self._closers: list[Closer] = []
        self._chunk_hooks: list[Meter] = []
        self._closed = False
        if body is None:
            self._meter = StreamMeter()
            self._text = TextMeter()
            self._unfed = first
            if first is not None:
                self._meter.feed(first)

    def expect_usage(self, anthropic: bool, framing: int) -> None:
        """This stream's engine reports its usage at the end (it was asked to, or its format
        carries it): its text is not scanned, and a stream cut before the report counts one
        output token per content event (StreamMeter.count_events)."""
        if self._meter is not None:
            self._meter.count_events(anthropic, framing)
        self._text = self._unfed = None

    def read_usage(self, found: tuple[int, int | None]) -> None:
        """The usage the stream's last line with usage reports, as `StreamMeter.reported`
        would read it, found by whoever already parsed that line (the relay's usage-event
        filter): the meter does not search for it again."""
        self._reported = found

    @property
    def expects_usage(self) -> bool:
        return self._meter is not None and self._meter.counts_events

    @property
    def event_counting(self) -> tuple[bool, int]:
        """The arguments `expect_usage` was given, for an answer that wraps this one."""
        return self._meter.counting if self._meter is not None else (False, 0)

    @property
    def streamed(self) -> bool:
        return self.body is None

    def header(self, name: str) -> str | None:
        for key, value in self.headers:
            if key.lower() == name:
                return value
        return None

    def on_chunk(self, hook: Meter) -> None:
        """Call `hook` with every chunk read after the first (the first is `self.first`)."""
        self._chunk_hooks.append(hook)

    def on_close(self, hook: Closer) -> None:
        self._closers.append(hook)

    async def next_chunk(self) -> bytes | None:
        chunk = await self.source.read()
        if chunk is not None:
            if self._meter is not None:
                self._meter.feed(chunk)
                if self._text is not None:
                    self._feed_text(chunk)
            for hook in self._chunk_hooks:
                hook(chunk)
        return chunk

    def _feed_text(self, chunk: bytes | None) -> None:
        assert self._text is not None
        if self._unfed is not None:
            self._text.feed(self._unfed)
            self._unfed = None
        if chunk is not None:
            self._text.feed(chunk)

    def _whole_usage(self, body: bytes) -> Usage | None:
        if self.status >= 400:
            return None
        usage = from_body(body)
        if usage is not None:
            return usage
        text = body_text_bytes(body)
        if text is None:
            return None  # nothing generated here to count (embeddings, count_tokens)
        self.usage_estimated = True
        return Usage(self.input_estimate, math.ceil(text / OUTPUT_BYTES_PER_TOKEN))

    def _stream_usage(self) -> Usage | None:
        meter = self._meter
        if meter is None or self.status >= 400:
            return None
        reported = self._reported or meter.reported()
        if reported is not None and reported[1] is not None:
            if reported[0] is None:
                # An input the stream did not report (its start not found) is the estimate,
                # which admission must not learn from as if an engine had counted it.
                self.usage_estimated = True
                return Usage(self.input_estimate, reported[1])
            return Usage(reported[0], reported[1])
        # No output count: counted from the events or the text relayed, the input as
        # reported or estimated.
        self.usage_estimated = True
        prompt = reported[0] if reported is not None and reported[0] else self.input_estimate
        if self._text is None:
            return Usage(prompt, meter.event_tokens())
        self._feed_text(None)
        return Usage(prompt, self._text.tokens())

    @property
    def closed(self) -> bool:
        return self._closed

    async def close(self, outcome: Outcome) -> None:
        """Settle the answer once. Hooks that hold local state finish without suspending,
        so a close that runs while its task is being cancelled still completes."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.body is not None:
                self.usage = self._whole_usage(self.body)
            else:
                self.usage = self._stream_usage()
        except Exception:  # an answer no reader foresaw: unaccounted, but still closed
            log.exception("reading an answer's usage failed")
        closers, self._closers = self._closers, []
        # Hooks close over their stages, which point back at this answer: dropping them
        # here frees a finished request by reference counting, not by a later cycle scan.
        self._chunk_hooks = []
        try:
            self.source.close(outcome)
        finally:
            cancelled: BaseException | None = None
            for hook in reversed(closers):
                try:
                    pending = hook(outcome, self.usage)
                    if pending is not None:
                        await pending
                except Exception:
                    log.exception("a close hook of an answer failed")
                except BaseException as exc:  # cancelled while a hook waited
                    # The hooks still to run give back what earlier stages took (slots,
                    # streams): they run all the same, and the cancellation goes on after.
                    cancelled = cancelled or exc
            if cancelled is not None:
                raise cancelled
