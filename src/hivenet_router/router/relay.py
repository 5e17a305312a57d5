"""Write an Answer to the client, then close it with how it ended.

A whole answer goes out in one response. A stream is relayed chunk by chunk; once its head
is in, the request's deadline (`--request-timeout`) no longer applies: the stream may go
on while chunks keep coming (no gap longer than `--stream-idle-timeout`) up to
`--max-stream-duration` after the request arrived. If it breaks part-way (the source
fails, a stream limit runs out, the router is shutting down) it ends with one error event
in the envelope every error has, so the client's SDK raises instead of taking a truncated
answer for a whole one. Whatever happens, the answer is closed exactly once with its
outcome, which gives back everything the request held.

On OpenAI streams whose client did not ask for usage, the usage event (which the router
asked the engine for) is left out of what the client is sent; the answer is metered from
what it read, usage included.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Protocol

from hivenet_router.domain.answer import Answer, AnswerBroken, Outcome
from hivenet_router.domain.errors import ApiError, ErrorCode, error_body
from hivenet_router.domain.usage import (
    USAGE_ROUTES,
    UsageEvents,
    input_estimate,
    wants_usage,
)
from hivenet_router.expiry import Deadlines, Watch
from hivenet_router.http1 import messages as http
from hivenet_router.pipeline.ticket import Ticket

_JSON = "application/json"
# How long the error event that ends a broken stream may wait for the client to read: past
# it the event is dropped, so a client that stopped reading cannot keep what the request
# holds (its forwarding slot, its agent stream) after the stream has ended.
ERROR_WRITE = 1.0
# Routes whose streams end an error with an `event: error` line (their SDKs read it).
_NAMED_ERRORS = ("/v1/messages", "/v1/responses")


class Reshape(Protocol):
    """Rewrites a stream chunk by chunk for its client; `finished` once the client has
    been sent the answer's last event."""

    finished: bool

    def __call__(self, chunk: bytes) -> bytes: ...

    def flush(self) -> bytes: ...


class Shape(Protocol):
    """How a route answers in another API than the engine's (the Responses API over chat
    completions): a whole answer rewritten, or a stream's rewriter. Only answers under 400
    are rewritten; an error passes in the one envelope every route shares. The answer is
    metered as the engine sent it."""

    def whole(self, body: bytes) -> bytes:
        """Raises ValueError for an answer it cannot read."""
        ...

    def stream(self) -> Reshape: ...


class Relay:
    def __init__(self, idle_timeout: float = 0.0) -> None:
        self.stopping = False  # set when the shutdown grace is over and streams are cut
        self.deadlines = Deadlines()  # each stream's, on one timer per 50 ms
        self.idle_timeout = idle_timeout  # longest gap between two chunks; 0: none

    async def __call__(
        self, request: http.Request, ticket: Ticket, answer: Answer, shape: Shape | None = None
    ) -> http.Answer:
        ticket.origin = ticket.origin or answer.origin
        if ticket.facts is not None and not answer.input_estimate:
            # The input counted for an answer that reports none (domain/usage.py).
            answer.input_estimate = input_estimate(ticket.facts)
        if answer.status >= 400:
            shape = None
        if answer.body is not None:
            return await self._whole(ticket, answer, answer.body, shape)
        return await self._stream(request, ticket, answer, shape.stream() if shape else None)

    async def _whole(
        self, ticket: Ticket, answer: Answer, body: bytes, shape: Shape | None
    ) -> http.Response:
        if shape is not None:
            try:
                body = shape.whole(body)
            except Exception:  # ValueError by contract; whatever it is, the answer is closed
                await self._close(ticket, answer, Outcome.BROKEN)
                raise ApiError(
                    ErrorCode.BACKEND_ERROR, "the engine's answer is not a chat completion"
                ) from None
        response = http.Response(
            body, answer.status, answer.header("content-type") or _JSON, ticket.headers_out
        )
        await self._close(ticket, answer, Outcome.OK)
        return response

    async def _stream(
        self, request: http.Request, ticket: Ticket, answer: Answer, reshape: Reshape | None
    ) -> http.Answer:
        headers = {
            **ticket.headers_out,
            "Content-Type": answer.header("content-type") or "text/event-stream",
            "Cache-Control": "no-cache",
            "X-Request-ID": ticket.request_id,
        }
        outcome = Outcome.CLIENT_GONE
        written = b""  # the last chunk the client was sent
        response: http.Stream | None = None
        # A reshaped stream reads the usage event itself (the Response carries it).
        drop: Reshape | UsageEvents | None = reshape or _usage_events(ticket, answer)
        time = asyncio.get_running_loop().time
        watch = Watch(time(), self.idle_timeout, ticket.stream_end or ticket.deadline)
        try:
            response = await http.stream(request, answer.status, headers)
            with self.deadlines.watch(watch):
                chunk = answer.first
                while chunk is not None:
                    watch.last = time()  # one store per chunk: the watch reads it when due
                    if drop is not None:
                        chunk = drop(chunk)
                    if chunk:
                        await response.write(chunk)
                        written = chunk
                    chunk = await answer.next_chunk()
                if drop is not None and (chunk := drop.flush()):
                    await response.write(chunk)
                    written = chunk
            outcome = Outcome.OK
        except AnswerBroken as exc:
            outcome = Outcome.BROKEN
            await self._end_with_error(response, ticket, exc.code, f"stream interrupted: {exc}")
        except TimeoutError:
            outcome = Outcome.TIMEOUT
            await self._end_with_error(
                response,
                ticket,
                ErrorCode.REQUEST_TIMEOUT,
                self._timed_out(watch, time(), watch.end - ticket.started),
            )
        except asyncio.CancelledError:
            if complete(written) or (reshape is not None and reshape.finished):
                # SDKs hang up as soon as they read the last event, often before the
                # source's own end arrives: the client had the whole answer.
                outcome = Outcome.OK
            elif self.stopping:
                outcome = Outcome.BROKEN
                await self._end_with_error(
                    response,
                    ticket,
                    ErrorCode.AGENT_DISCONNECTED,
                    "stream interrupted: the router is shutting down",
                )
                if response is not None:
                    # The body ends after its error event: without the last chunk an HTTP
                    # client reports a broken transfer on top of the error.
                    with contextlib.suppress(ConnectionError):
                        await response.end()
            raise
        finally:
            if type(drop) is UsageEvents and drop.found is not None:
                answer.read_usage(drop.found)
            await self._close(ticket, answer, outcome)
        # Only a cancellation can leave before the stream began, and that one propagates.
        assert response is not None
        with contextlib.suppress(ConnectionError):
            await response.end()
        return response

    def _timed_out(self, watch: Watch, now: float, longest: float) -> str:
        if watch.ended(now):
            return f"the stream ran past --max-stream-duration ({longest:g}s)"
        return f"no chunk came for --stream-idle-timeout ({self.idle_timeout:g}s)"

    @staticmethod
    async def _close(ticket: Ticket, answer: Answer, outcome: Outcome) -> None:
        await answer.close(outcome)
        ticket.outcome, ticket.usage = outcome, answer.usage

    @staticmethod
    async def _end_with_error(
        response: http.Stream | None, ticket: Ticket, code: ErrorCode, message: str
    ) -> None:
        """One error event: the envelope every error has, as an `event: error` on
        /v1/messages and /v1/responses, and as a bare `data:` line elsewhere (none if the
        stream never began)."""
        ticket.failure = code
        if response is None:
            return
        data = b"data: " + error_body(code, message, request_id=ticket.request_id) + b"\n\n"
        if ticket.endpoint.startswith(_NAMED_ERRORS):
            data = b"event: error\n" + data
        with contextlib.suppress(ConnectionError, TimeoutError):
            async with asyncio.timeout(ERROR_WRITE):
                await response.write(data)


def _usage_events(ticket: Ticket, answer: Answer) -> UsageEvents | None:
    """What keeps the usage event from an OpenAI stream whose client did not ask for it
    (the router asks the engine on its behalf, router/dispatch.py); None to relay as is."""
    job = ticket.job
    if job is None or job.route not in USAGE_ROUTES or answer.status >= 400:
        return None
    return None if wants_usage(job.body) else UsageEvents()


def complete(chunk: bytes) -> bool:
    """Does this chunk end a whole answer: OpenAI's `[DONE]` or Anthropic's message_stop?"""
    tail = chunk[-64:]
    return tail.rstrip().endswith(b"data: [DONE]") or b"event: message_stop" in chunk[-256:]
