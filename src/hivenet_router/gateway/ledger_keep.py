"""The ledger's counters, and the keeper of charges on their way to the local disk.

A charge the ledger cannot take now waits in memory until a background writer has put it
in the pending store (gateway/pending.py). A disk that refuses (full, read-only) is
retried with backoff while the router runs; at shutdown the writer gets a bounded time,
and what is still not written is logged and counted as lost: a shutdown never hangs on it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Final, Generic, TypeVar

from hivenet_router.gateway.pending import Charge, PendingStore

log = logging.getLogger("hivenet.router")
_A = TypeVar("_A")

DISK_TIMEOUT: Final = 5.0  # at shutdown: the last write of unbilled charges to disk
MEMORY_MAX: Final = 100_000  # charges kept in memory while the disk refuses them
RETRY_MAX: Final = 30.0  # the writer's pause between tries on a refusing disk, at most
REFUSALS: Final = ("insufficient", "no_wallet", "currency", "no_price", "busy")
SETTLE_BATCH: Final = 256  # charges of the request path settled per statement, at most
# Holds per statement, at most: the wallets of a batch stay locked until its last hold is
# taken, and other routers' holds wait on them; a small batch keeps that wait short.
HOLD_BATCH: Final = 16
ERROR_KINDS: Final = ("connect", "timeout", "query", "schema", "pending", "busy", "rejected")


@dataclass(slots=True)
class LedgerStats:
    unbilled: int = 0
    charges: int = 0
    holds_expired: int = 0
    lost: int = 0  # charges neither billed nor kept on disk
    refused: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REFUSALS, 0))
    errors: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ERROR_KINDS, 0))


class ChargeKeeper:
    """Charges (with a dead-letter reason, or None: to bill) on their way to disk."""

    def __init__(
        self, pending: PendingStore, stats: LedgerStats, written: Callable[[], None]
    ) -> None:
        self.pending = pending
        self.stats = stats
        self._written = written  # called once what waited is on disk
        self._queue: list[tuple[Charge, str | None]] = []
        self._writer: asyncio.Task[None] | None = None

    @property
    def waiting(self) -> int:
        """Charges to bill still in memory."""
        return sum(1 for _, dead in self._queue if dead is None)

    @property
    def waiting_dead(self) -> int:
        return len(self._queue) - self.waiting

    @property
    def writer(self) -> asyncio.Task[None] | None:
        """The writer while it runs (idle() waits for it)."""
        return self._writer if self._writer is not None and not self._writer.done() else None

    def keep(self, charge: Charge, dead: str | None = None) -> None:
        if len(self._queue) >= MEMORY_MAX:  # the disk has refused them for a long while
            self.stats.lost += 1
            if self.stats.lost == 1 or self.stats.lost % 1000 == 0:
                log.error("%d unbilled charges lost: the disk refuses them", self.stats.lost)
            return
        self._queue.append((charge, dead))
        if self.writer is None:
            self._writer = asyncio.get_running_loop().create_task(self._write_all())

    async def _write_all(self) -> None:
        delay = 1.0
        while self._queue:
            batch, self._queue = self._queue, []
            try:
                await self._write(batch)
            except asyncio.CancelledError:
                self._queue[:0] = batch  # finish() writes them itself
                raise
            except Exception as exc:
                self.stats.errors["pending"] += 1
                if delay == 1.0:  # once per streak of failures
                    log.error("cannot keep %d unbilled charges on disk: %s", len(batch), exc)
                self._queue[:0] = batch  # still in memory; try again
                await asyncio.sleep(delay)
                delay = min(delay * 2, RETRY_MAX)
        self._written()

    async def _write(self, batch: list[tuple[Charge, str | None]]) -> None:
        await self.pending.add([charge for charge, dead in batch if dead is None])
        for charge, dead in batch:
            if dead is not None:
                await self.pending.add([charge], dead)

    async def finish(self, wait: float) -> None:
        """At shutdown: give the writer `wait` seconds, then write the rest once, within
        DISK_TIMEOUT; what the disk still refuses is logged and counted as lost."""
        writer = self.writer
        if writer is not None:
            _, late = await asyncio.wait([writer], timeout=wait)
            if late:
                writer.cancel()  # a refusing disk: it would retry forever
                await asyncio.gather(writer, return_exceptions=True)
        if not self._queue:
            return
        batch, self._queue = self._queue, []
        try:
            async with asyncio.timeout(DISK_TIMEOUT):
                await self._write(batch)
        except Exception as exc:
            self.stats.lost += len(batch)
            log.error(
                "%d unbilled charges lost: they cannot be written to %s (%s)",
                len(batch),
                self.pending.path,
                exc or type(exc).__name__,
            )


class SettleQueue:
    """Charges to settle, sent by one task a batch at a time: while a batch is in flight the
    next one gathers, so a busy router makes one database call per batch, not per request.
    `send` keeps what it cannot settle; what is still queued when the task is cancelled (a
    shutdown) goes to `keep`."""

    def __init__(
        self,
        send: Callable[[list[Charge]], Awaitable[None]],
        keep: Callable[[list[Charge]], None],
        tasks: set[asyncio.Task[None]],
        size: int = SETTLE_BATCH,
    ) -> None:
        self._send = send
        self._keep = keep
        self._tasks = tasks  # the ledger's tasks in flight: idle() and close() wait on them
        self._size = size
        self._queue: list[Charge] = []
        self._sender: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        return len(self._queue)

    def put(self, charge: Charge) -> None:
        self._queue.append(charge)
        if self._sender is None:
            task = asyncio.get_running_loop().create_task(self._run())
            self._sender = task
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _run(self) -> None:
        try:
            while self._queue:
                batch = self._queue[: self._size]
                del self._queue[: self._size]
                await self._send(batch)
        except asyncio.CancelledError:
            waiting, self._queue = self._queue, []
            self._keep(waiting)
            raise
        finally:
            self._sender = None  # at once: a charge queued from now on starts a new sender


class TurnGather(Generic[_A]):
    """The calls made during one turn of the event loop, sent together at its end: each
    caller gets its own result (a string, or the exception `send` gave for it), `size`
    calls per batch at most. Nothing waits beyond the turn; a batch still in flight does
    not hold back the next one.

    A call whose caller goes away (cancelled) is still sent with its batch, and once the
    batch has been answered (or cut), `abandoned` is called with its argument: what it
    took can be given back after it was taken, never before.
    """

    def __init__(
        self,
        send: Callable[[list[_A]], Awaitable[list[str | Exception]]],
        size: int = HOLD_BATCH,
        abandoned: Callable[[_A], None] = lambda arg: None,
    ) -> None:
        self._send = send
        self._size = size
        self._abandoned = abandoned
        self._waiting: list[tuple[_A, asyncio.Future[str]]] = []
        self._tasks: set[asyncio.Task[None]] = set()

    async def __call__(self, arg: _A) -> str:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[str] = loop.create_future()
        self._waiting.append((arg, future))
        if len(self._waiting) == 1:
            loop.call_soon(self._flush)
        try:
            return await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                # Answered, but cancelled before it could take the answer: the batch saw
                # a caller still there, so the giving back is left to this side.
                self._abandoned(arg)
            raise

    async def wait(self, timeout: float) -> None:
        """Wait (at most `timeout` seconds) for the batches in flight to be answered, so
        that what their abandoned calls give back is queued."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout)

    def _flush(self) -> None:
        waiting, self._waiting = self._waiting, []
        for start in range(0, len(waiting), self._size):
            batch = waiting[start : start + self._size]
            task = asyncio.get_running_loop().create_task(self._run(batch))
            self._tasks.add(task)  # held until done: the loop keeps only weak references
            task.add_done_callback(self._tasks.discard)

    async def _run(self, batch: list[tuple[_A, asyncio.Future[str]]]) -> None:
        try:
            results = await self._send([arg for arg, _ in batch])
        except asyncio.CancelledError:
            for arg, future in batch:  # cut: nobody knows what was taken
                future.cancel()
                self._abandoned(arg)
            raise
        except Exception as exc:  # every caller hears of it
            results = [exc] * len(batch)
        for (arg, future), result in zip(batch, results, strict=True):
            if future.done():  # its caller went away
                self._abandoned(arg)
                continue
            if isinstance(result, Exception):
                future.set_exception(result)
            else:
                future.set_result(result)
