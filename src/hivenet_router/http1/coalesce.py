"""Writes of one event-loop turn sent in one system call.

Small writes made while the loop runs its ready callbacks (the frames of many requests on
one link, the chunks of a stream that arrived together, a stream's last chunk and its end)
wait in a list and go to the transport together when the turn ends. A burst of FLUSH_AT
bytes or more goes at once, so the transport's backpressure (pause_writing) is seen as
soon as it would have been without the queue.

A turn can be long: when 32 requests arrive together, the router handles all of them in
one turn, a few hundred microseconds each. Had the first one's frame waited for the turn's
end, every request of the burst would reach its agent only after the last was handled,
milliseconds later. So a write that finds the queue older than MAX_WAIT sends it at once:
a queued write waits until the next write comes more than MAX_WAIT after it, or until the
turn ends. At 32 connections this keeps several frames per write and took 20% off the
median latency of 1 KB JSON answers (docs/benchmarks.md, "A bound on the wait").
Used by the public HTTP server's streamed answers and by both ends of the agent link.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

FLUSH_AT = 64 * 1024
MAX_WAIT = 0.0005  # seconds
# Not the loop's clock: uvloop's counts whole milliseconds.
_clock = time.monotonic


class TurnWriter:
    """Queue writes; `send` gets them joined at the end of the turn. `send` decides whether
    the transport can still take them (its owner knows when it is closing)."""

    __slots__ = ("_due", "_loop", "_pending", "_send", "_since", "_size")

    def __init__(self, loop: asyncio.AbstractEventLoop, send: Callable[[bytes], None]) -> None:
        self._loop = loop
        self._send = send
        self._pending: list[bytes] = []
        self._size = 0
        self._since = 0.0  # when the oldest queued write came
        self._due = False

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def add(self, data: bytes) -> None:
        pending = self._pending
        if pending:
            pending.append(data)
            self._size += len(data)
            if self._size >= FLUSH_AT or _clock() - self._since >= MAX_WAIT:
                self.flush()
            return
        if len(data) >= FLUSH_AT:
            self._send(data)
            return
        pending.append(data)
        self._size = len(data)
        self._since = _clock()
        if not self._due:
            self._due = True
            self._loop.call_soon(self._at_turn_end)

    def now(self, data: bytes) -> None:
        """Send `data` at once, behind whatever is queued (in the same write)."""
        if self._pending:
            self._pending.append(data)
            self.flush()
        else:
            self._send(data)

    def _at_turn_end(self) -> None:
        self._due = False
        self.flush()

    def flush(self) -> None:
        """Send what is queued now."""
        pending = self._pending
        if not pending:
            return
        data = pending[0] if len(pending) == 1 else b"".join(pending)
        self._pending = []
        self._size = 0
        self._send(data)

    def drop(self) -> None:
        """The connection is gone: forget what is queued, and the owner's `send` (a bound
        method: holding it would keep the owner in a reference cycle with this queue)."""
        self._pending = []
        self._size = 0
        self._send = _nowhere


def _nowhere(data: bytes) -> None:
    pass
