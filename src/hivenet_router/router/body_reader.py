"""Reading request bodies without stalling the router: the costly ones in a child process.

A 10 MiB JSON body can hold millions of tiny values (empty objects, token IDs, parts of
made-up types). Decoding and measuring one takes the best part of a second of Python and
builds hundreds of megabytes of objects. In the router's process that second stalls every
other request (on a thread too: the decoder holds the interpreter lock, and a thread that
walks Python objects starves the event loop of it), so the router hands such bodies to this
child and keeps serving while it reads them.

`BodyReader` decides. A body under `LARGE_BODY`, or a larger one with fewer than
`DENSE_VALUES` commas (each value of an array or object after the first needs one: long
text, images and documents have few), is read at once, in a few milliseconds at most.
Any other goes to the child.

The parent (`BodyWorker`) starts the child on first use and sends it one body at a time,
tenants taking turns (`FairTurns`), over its stdin; the child answers on its stdout
(MessagePack) with the `RequestFacts` or the refusal that `bodies.parse` gave. A child
whose memory grew past its bound (bytes, its argument; `RETIRE_RSS` by default) says so
with its answer and exits, and the next body starts a fresh one. A child that dies while
reading, or takes longer than `READ_TIMEOUT`, fails the body it was reading (413) and is
replaced; one that died while idle is replaced before the next body. The child ignores
SIGINT (a terminal's Ctrl-C reaches the whole process group; the router decides when to
stop) and exits when its stdin closes, so it never outlives the router.

    python -m hivenet_router.router.body_reader [RETIRE_RSS]    # what the parent runs
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import signal
import struct
import sys
from typing import Final

import msgspec

from hivenet_router.domain.errors import ApiError, ErrorCode
from hivenet_router.domain.request import RequestFacts
from hivenet_router.router.bodies import ROUTES, parse

log = logging.getLogger("hivenet.router")

LARGE_BODY: Final = 256 * 1024  # bytes: smaller bodies are always read at once
DENSE_VALUES: Final = 20_000  # commas: a large body with as many is read by the child

READ_TIMEOUT: Final = 30.0  # seconds one body may take; then the child is replaced
RETIRE_RSS: Final = 160 * 1024 * 1024  # bytes: a child this large exits after answering
_ASK = struct.Struct("!BI")  # route index, body length
_ANSWER = struct.Struct("!IB")  # payload length, 1 if the child exits after this answer


class _Answer(msgspec.Struct, omit_defaults=True):
    """What the child sends back: the facts, or the refusal's code and message (no code:
    a bug, which the router answers as it would its own)."""

    facts: RequestFacts | None = None
    code: str = ""
    message: str = ""


_ENCODE = msgspec.msgpack.Encoder().encode
_DECODE = msgspec.msgpack.Decoder(_Answer).decode


class BodyReader:
    """`bodies.parse` for the event loop: cheap bodies at once, costly ones by the child."""

    def __init__(self, large: int = LARGE_BODY, dense: int = DENSE_VALUES) -> None:
        self.large = large
        self.dense = dense
        self.worker = BodyWorker()

    async def parse(self, route: str, body: bytes, tenant: str = "") -> RequestFacts:
        """`tenant`: whose body it is (bodies read by the child take turns by tenant)."""
        if len(body) < self.large or body.count(b",") < self.dense:
            return parse(route, body)
        return await self.worker.parse(route, body, tenant)

    async def close(self) -> None:
        await self.worker.close()


class FairTurns:
    """One holder at a time; waiters served in turn by tenant, first come first served
    within one. A tenant with many bodies waiting delays another tenant's body by the one
    being read and one more at most, not by all of them."""

    def __init__(self) -> None:
        self._busy = False
        self._waiting: dict[str, collections.deque[asyncio.Future[None]]] = {}

    def __len__(self) -> int:
        return sum(len(queue) for queue in self._waiting.values())

    async def acquire(self, who: str) -> None:
        if not self._busy:
            self._busy = True
            return
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(who, collections.deque()).append(turn)
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self.release()  # handed the turn as it left: pass it on
            else:
                queue = self._waiting.get(who)
                if queue is not None and turn in queue:
                    queue.remove(turn)
                    if not queue:
                        del self._waiting[who]
            raise

    def release(self) -> None:
        """Hand the turn to the longest-waiting tenant's first waiter (dicts keep their
        order: a served tenant with more waiting goes to the back), or free it."""
        while self._waiting:
            who, queue = next(iter(self._waiting.items()))
            del self._waiting[who]
            turn = queue.popleft()
            if queue:
                self._waiting[who] = queue
            if not turn.done():
                turn.set_result(None)
                return
        self._busy = False


class _ChildGone(Exception):
    """The child ended (or was ended) before it answered."""


class BodyWorker:
    """The parent's side: one child, one body at a time, in the order asked."""

    def __init__(self, retire_rss: int = RETIRE_RSS) -> None:
        self.retire_rss = retire_rss
        self._proc: asyncio.subprocess.Process | None = None
        self._turns = FairTurns()
        self._closed = False
        self.started = 0  # children started so far

    @property
    def pid(self) -> int | None:
        """The child's process ID while one runs."""
        return self._proc.pid if self._proc is not None else None

    async def parse(self, route: str, body: bytes, tenant: str = "") -> RequestFacts:
        """`bodies.parse` in the child, tenants' bodies taking turns. A caller that leaves
        while its body is being read leaves the exchange to finish, so the next body meets
        a child ready for it."""
        await self._turns.acquire(tenant)
        exchange = asyncio.ensure_future(self._exchange(route, body))
        exchange.add_done_callback(self._finished)
        return await asyncio.shield(exchange)

    def _finished(self, exchange: asyncio.Future[RequestFacts]) -> None:
        self._turns.release()
        if not exchange.cancelled():
            exchange.exception()  # seen here: its caller may have gone

    async def _exchange(self, route: str, body: bytes) -> RequestFacts:
        if self._closed:
            return parse(route, body)  # shutting down: no child to start or ask
        try:
            answer = await self._ask(route, body)
        except _ChildGone as exc:
            log.warning(
                "the body reader process ended while reading a %d-byte body (%s); "
                "the request gets a 413 and the next body a new process",
                len(body),
                exc,
            )
            raise ApiError(
                ErrorCode.REQUEST_TOO_LARGE, "the request body is too costly to read"
            ) from None
        except OSError as exc:  # no child could be started (out of processes or files)
            log.warning("cannot start the body reader process (%s): reading here", exc)
            return parse(route, body)
        if answer.facts is not None:
            return answer.facts
        if answer.code:
            raise ApiError(ErrorCode(answer.code), answer.message)
        raise RuntimeError(answer.message)

    async def _ask(self, route: str, body: bytes) -> _Answer:
        proc = self._proc
        if proc is not None and proc.returncode is not None:
            # Died while idle (an operator, the OOM killer): the body is not to blame.
            await self._stop(proc)
            proc = None
        if proc is None:
            proc = await self._start()
            if self._closed:  # closed while it started
                await self._stop(proc)
                raise _ChildGone("closed")
        assert proc.stdin is not None and proc.stdout is not None
        try:
            async with asyncio.timeout(READ_TIMEOUT):
                proc.stdin.write(_ASK.pack(ROUTES.index(route), len(body)))
                proc.stdin.write(body)
                await proc.stdin.drain()
                size, retiring = _ANSWER.unpack(await proc.stdout.readexactly(_ANSWER.size))
                answer = _DECODE(await proc.stdout.readexactly(size))
        except (TimeoutError, OSError, asyncio.IncompleteReadError) as exc:
            await self._stop(proc)
            raise _ChildGone(type(exc).__name__) from None
        if retiring:
            await self._stop(proc)
        return answer

    async def _start(self) -> asyncio.subprocess.Process:
        self._proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            __name__,
            str(self.retire_rss),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        self.started += 1
        return self._proc

    async def _stop(self, proc: asyncio.subprocess.Process) -> None:
        if self._proc is proc:
            self._proc = None
        with contextlib.suppress(ProcessLookupError):
            if proc.returncode is None and proc.stdin is not None:
                proc.stdin.close()  # it exits at the end of its input...
        try:
            await asyncio.wait_for(proc.wait(), 1.0)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()  # ...or is made to
            await proc.wait()

    async def close(self) -> None:
        """Stop the child; bodies asked from now on are read at once. A body still being
        read fails with a 413 (the router is stopping)."""
        self._closed = True
        if self._proc is not None:
            await self._stop(self._proc)


def _rss() -> int:
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0  # no /proc: never retire for size


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    retire_rss = int(sys.argv[1]) if len(sys.argv) > 1 else RETIRE_RSS
    asks, answers = sys.stdin.buffer, sys.stdout.buffer
    while True:
        head = asks.read(_ASK.size)
        if len(head) < _ASK.size:
            return  # the router closed our input: it is gone or stopping us
        route, size = _ASK.unpack(head)
        body = asks.read(size)
        if len(body) < size:
            return
        try:
            answer = _Answer(facts=parse(ROUTES[route], body))
        except ApiError as exc:
            answer = _Answer(code=exc.code.value, message=exc.message)
        except Exception as exc:  # a bug: the router answers it as it would its own
            answer = _Answer(message=f"reading a request body: {exc!r}")
        del body
        payload = _ENCODE(answer)
        retiring = _rss() > retire_rss
        answers.write(_ANSWER.pack(len(payload), retiring))
        answers.write(payload)
        answers.flush()
        if retiring:
            return


if __name__ == "__main__":
    main()
