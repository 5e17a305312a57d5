"""One answer in flight, read by many: identical requests share one engine call.

The first request of a key starts a flight: one task (the pump) opens the upstream answer
and reads it into a buffer, chunk by chunk, as fast as the upstream gives it. Every request
of that key, the first included, reads the buffer through its own cursor (a `Reader`, the
source of its own `Answer`), so each client goes at its own pace: a slow reader never
slows the pump or the others, and chunks are shared by reference, never copied.

A reader that leaves does not stop the flight while another still reads; when the last one
leaves before the end, the pump is cancelled and the upstream closed as `client_gone`, so
the engine stops. The upstream answer is closed exactly once, by the pump, when it ends:
its close hooks (admission, dispatch's slots) run then. A failure reaches every reader at
the same point: a refusal before the head (`ApiError`) as the same error, a break
mid-stream (`AnswerBroken`) after the same bytes, each reader raising its own copy.

The pump reads within the latest stream deadline (--max-stream-duration) of the requests
that joined (so one that joined late is not cut at the first one's), never past twice the
first one's allowance. A stream that stalls is ended by its readers' relays
(--stream-idle-timeout): when the last one leaves, the pump stops.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from typing import Final

from hivenet_router.domain.answer import Answer, AnswerBroken, Outcome
from hivenet_router.domain.errors import ApiError, ErrorCode

log = logging.getLogger("hivenet.cache")

MAX_READERS: Final = 10_000  # readers of one flight; more go on by themselves
# Response headers a shared refusal carries to every reader (the rest are the first
# request's own: its rate-limit figures, its trace).
SHARED_HEADERS: Final = ("Retry-After",)

Opener = Callable[[], Awaitable[Answer]]


class OwnError(Exception):
    """The flight's first request was refused for reasons of its own (its limits, its
    wallet): the others are not refused with it but go on by themselves."""


class Flight:
    """One upstream answer and its buffer. Made by the stage, started once, read by
    `join()`ed readers."""

    def __init__(
        self, key: str, on_end: Callable[[Flight, Outcome], None], max_readers: int = MAX_READERS
    ) -> None:
        self.key = key
        self.max_readers = max_readers
        self.status = 0
        self.headers: list[tuple[str, str]] = []
        self.body: bytes | None = None  # a whole answer; None for a stream
        self.origin = ""
        self.chunks: list[bytes] = []
        self.size = 0  # bytes in `chunks` (or the whole body)
        self.ended = False  # the pump is over, however it ended
        self.complete = False  # ... and the upstream was read to its end
        self.keep = True  # the upstream did not say it must not be served again
        self.failure: AnswerBroken | None = None  # mid-stream, after `chunks`
        self.refusal: BaseException | None = None  # before the head
        self.own = False  # `refusal` was the first request's own
        self.stopped = False  # `refusal` is no upstream's: the flight was stopped before it
        self.refusal_headers: dict[str, str] = {}  # SHARED_HEADERS that came with `refusal`
        self.deadline = 0.0  # the pump reads until then (loop time); later joiners extend it
        self.readers = 0
        self.stopping = False  # the last reader left: the pump is being cancelled
        self.keepers = 0  # readers that are no client (the site publisher): woken when alone
        self.remote = False  # the answer came from a flight on another router of the site
        self.stored: object = None  # what the stage kept of it, for the site publisher
        # A reader with a say in billing (`join(on_bill=...)`) has reached the end of the
        # answer: it was told it pays for the call, and every later one that it does not.
        self.billed = False
        self._on_end = on_end
        self._head = asyncio.Event()
        self._more = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._latest = 0.0  # how far joiners may extend `deadline`
        self._timer: asyncio.Timeout | None = None  # the stream's, while it is read

    @property
    def head_ready(self) -> bool:
        return self._head.is_set()

    @property
    def joinable(self) -> bool:
        return not (self.ended or self.stopping) and self.readers < self.max_readers

    def start(self, opener: Opener, deadline: float, tasks: set[asyncio.Task[None]]) -> None:
        """Run the pump; the upstream's stream is read within `deadline` (loop time).
        `tasks` holds the pump until it ends (the loop keeps only weak references)."""
        loop = asyncio.get_running_loop()
        self.deadline = deadline
        # A steady trickle of joiners must not keep a stalled upstream forever.
        self._latest = deadline + max(deadline - loop.time(), 0.0)
        task = self._task = asyncio.get_running_loop().create_task(self._pump(opener))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        # A pump cancelled before it ran never reaches its own end: end it here.
        task.add_done_callback(lambda _: self._end(Outcome.CLIENT_GONE))

    def join(
        self,
        first: bool = False,
        keeper: bool = False,
        deadline: float | None = None,
        on_bill: Callable[[bool], None] | None = None,
    ) -> Reader:
        """A reader of the flight; `deadline` (loop time, the joining request's own) lets
        the pump read that long, within twice the first request's allowance. `on_bill` is
        called once, when this reader reaches the end of the answer (a whole body in hand,
        or a complete stream read to its last chunk): True if it is the first reader with
        an `on_bill` to get there (it pays for the call), False if another got there
        first. A reader that never gets there is not called."""
        self.readers += 1
        self.keepers += keeper
        if deadline is not None:
            self._extend(deadline)
        return Reader(self, first, keeper, on_bill)

    def _extend(self, deadline: float) -> None:
        later = min(deadline, self._latest)
        if later <= self.deadline:
            return
        self.deadline = later
        if self._timer is not None:
            self._timer.reschedule(later)

    def _leave(self, keeper: bool) -> None:
        self.readers -= 1
        self.keepers -= keeper
        if self.keepers and self.readers == self.keepers and not self.ended:
            self.wake()  # the keeper decides whether to go on without clients
        if self.readers == 0 and not self.ended and self._task is not None:
            # Nobody is left to read: stop the upstream (the pump closes it). From now on
            # an identical request starts a flight of its own.
            self.stopping = True
            self._task.cancel()

    # -- the pump -----------------------------------------------------------------------------

    async def _pump(self, opener: Opener) -> None:
        try:
            upstream = await opener()
        except asyncio.CancelledError:
            self._end(Outcome.CLIENT_GONE)
            raise
        except OwnError as exc:
            self.own = True
            self._refuse(exc.__cause__ or exc)
            return
        except Exception as exc:
            self._refuse(exc)
            return
        self.status, self.headers, self.origin = upstream.status, upstream.headers, upstream.origin
        self.body = upstream.body
        if upstream.body is not None:
            self.size = len(upstream.body)
        elif upstream.first is not None:
            self._append(upstream.first)
        self._head.set()
        self.wake()  # a keeper waiting for the head
        outcome = await self._read(upstream)
        self.keep = upstream.keep
        try:
            self._end(outcome)
        finally:
            await upstream.close(outcome)

    async def _read(self, upstream: Answer) -> Outcome:
        """Read the upstream to its end into the buffer; how it ended."""
        if upstream.body is not None or upstream.first is None:
            return Outcome.OK  # whole, or a stream with nothing in it (as the relay reads it)
        try:
            async with asyncio.timeout_at(self.deadline) as self._timer:
                while (chunk := await upstream.next_chunk()) is not None:
                    self._append(chunk)
            return Outcome.OK
        except AnswerBroken as exc:
            self.failure = exc
            return Outcome.BROKEN
        except TimeoutError:
            self.failure = AnswerBroken(
                ErrorCode.REQUEST_TIMEOUT, "the stream ran past --max-stream-duration"
            )
            return Outcome.TIMEOUT
        except asyncio.CancelledError:
            self.failure = AnswerBroken(ErrorCode.BACKEND_ERROR, "the shared answer was stopped")
            return Outcome.CLIENT_GONE
        except Exception as exc:
            log.exception("reading a shared answer failed")
            self.failure = AnswerBroken(ErrorCode.BACKEND_ERROR, f"stream failed: {exc}")
            return Outcome.BROKEN
        finally:
            self._timer = None

    def _append(self, chunk: bytes) -> None:
        self.chunks.append(chunk)
        self.size += len(chunk)
        self.wake()

    def wake(self) -> None:
        """Wake whoever waits for the flight to change (the site publisher)."""
        more, self._more = self._more, asyncio.Event()
        more.set()

    def _refuse(self, exc: BaseException) -> None:
        self.refusal = exc
        self._end(Outcome.BROKEN)

    def _end(self, outcome: Outcome) -> None:
        if self.ended:
            return
        self.ended = True
        if self.refusal is None and not self._head.is_set():
            # Stopped before its head (its readers left, or the stage is closing): a reader
            # still waiting gets an error, never an empty answer.
            self.stopped = True
            self.refusal = ApiError(
                ErrorCode.BACKEND_UNAVAILABLE, "the shared answer was stopped before it began"
            )
        self.complete = outcome is Outcome.OK and self.refusal is None
        self._head.set()
        self.wake()
        try:
            self._on_end(self, outcome)
        except Exception:
            log.exception("a flight's end hook failed")


class Reader:
    """One request's cursor over a flight: the source of its answer."""

    __slots__ = ("_cursor", "_first", "_flight", "_keeper", "_left", "_on_bill")

    def __init__(
        self,
        flight: Flight,
        first: bool,
        keeper: bool = False,
        on_bill: Callable[[bool], None] | None = None,
    ) -> None:
        self._flight = flight
        self._first = first  # the request that started the flight
        self._keeper = keeper
        self._on_bill = on_bill
        self._cursor = 0
        self._left = False

    async def answer(self, deadline: float, origin: str | None = None) -> Answer:
        """Wait (until `deadline`, loop time) for the flight's head, then this reader's
        answer. Raises the flight's refusal: to the first reader as it was raised (an
        `AnswerBroken` as an ApiError), to the others as a copy of their own, always an
        ApiError (OwnError when the refusal was the first request's own)."""
        flight = self._flight
        try:
            if not flight._head.is_set():
                async with asyncio.timeout_at(deadline):
                    await flight._head.wait()
        except TimeoutError:
            self.close(Outcome.TIMEOUT)
            raise ApiError(
                ErrorCode.REQUEST_TIMEOUT,
                "Request deadline exceeded waiting for an identical request's answer",
            ) from None
        except BaseException:
            self.close(Outcome.CLIENT_GONE)
            raise
        if flight.refusal is not None:
            self.close(Outcome.BROKEN)
            refusal = flight.refusal
            if self._first and not isinstance(refusal, AnswerBroken):
                raise refusal
            if flight.own and not self._first:
                raise OwnError()
            # One object raised from many readers would gather every reader's frames.
            raise _copy(refusal) from None
        where = flight.origin if origin is None else origin
        if flight.body is not None:
            self._at_end()
            return Answer(flight.status, flight.headers, self, body=flight.body, origin=where)
        first = flight.chunks[0] if flight.chunks else None
        self._cursor = 1
        return Answer(flight.status, flight.headers, self, first=first, origin=where)

    async def read(self) -> bytes | None:
        flight = self._flight
        while True:
            if self._cursor < len(flight.chunks):
                chunk = flight.chunks[self._cursor]
                self._cursor += 1
                return chunk
            if flight.failure is not None:
                raise AnswerBroken(flight.failure.code, flight.failure.message)
            if flight.ended:
                if flight.complete:
                    self._at_end()
                return None
            await flight._more.wait()

    def _at_end(self) -> None:
        """This reader has the whole answer: settle who pays for the call (`on_bill`)."""
        on_bill, self._on_bill = self._on_bill, None
        flight = self._flight
        if on_bill is None or flight.remote:  # a remote flight is its own router's to bill
            return
        first, flight.billed = not flight.billed, True
        on_bill(first)

    def available(self) -> list[bytes]:
        """Every chunk buffered past the cursor, at once (the site publisher batches)."""
        chunks = self._flight.chunks[self._cursor :]
        self._cursor += len(chunks)
        return chunks

    async def wait_head(self, timeout: float) -> None:
        """Until the flight's head (or refusal), a change (a reader leaving) or `timeout`."""
        flight = self._flight
        if flight._head.is_set():
            return
        try:
            async with asyncio.timeout(timeout):
                await flight._more.wait()
        except TimeoutError:
            pass

    async def wait(self, timeout: float) -> None:
        """Until the flight changes (a chunk, its end, a reader leaving) or `timeout`."""
        flight = self._flight
        if self._cursor < len(flight.chunks) or flight.ended:
            return
        try:
            async with asyncio.timeout(timeout):
                await flight._more.wait()
        except TimeoutError:
            pass

    def close(self, outcome: Outcome) -> None:
        if not self._left:
            self._left = True
            self._flight._leave(self._keeper)


def _copy(refusal: BaseException) -> ApiError:
    """A refusal as a reader of its own raises it: an ApiError, never a bare exception."""
    if isinstance(refusal, ApiError):
        return dataclasses.replace(refusal)
    if isinstance(refusal, AnswerBroken):
        return ApiError(refusal.code, refusal.message, "backend")
    return ApiError(ErrorCode.BACKEND_ERROR, "an identical request failed", "backend")


class Flights:
    """The flights of this router by key: the one a new identical request joins."""

    def __init__(self) -> None:
        self._by_key: dict[str, Flight] = {}

    def __len__(self) -> int:
        return len(self._by_key)

    def get(self, key: str) -> Flight | None:
        flight = self._by_key.get(key)
        return flight if flight is not None and flight.joinable else None

    def add(self, flight: Flight) -> bool:
        """Register `flight` unless a running one has its key."""
        if self.get(flight.key) is not None:
            return False
        self._by_key[flight.key] = flight
        return True

    def discard(self, flight: Flight) -> None:
        if self._by_key.get(flight.key) is flight:
            del self._by_key[flight.key]
