"""The injected clock: real time in production, a hand-moved clock in tests.

In tests the same ManualClock also drives the event loop's timers (VirtualTimeLoop), so a
deadline, a park timeout or a health sweep is tested by letting time jump, not by sleeping.
"""

from __future__ import annotations

import asyncio
import selectors
import time
from collections.abc import Coroutine, Mapping
from typing import Any, Protocol, TypeVar

T = TypeVar("T")


class Clock(Protocol):
    def monotonic(self) -> float:
        """Seconds on a monotonic scale, for intervals and deadlines."""
        ...

    def wall(self) -> float:
        """Seconds since the Unix epoch, for timestamps shown to people."""
        ...


class SystemClock:
    # The builtins themselves, not methods around them: routing reads the clock several
    # times per request, and a Python frame per read is measurable there.
    monotonic = staticmethod(time.monotonic)
    wall = staticmethod(time.time)


class ManualClock:
    """A clock that moves only when a test tells it to."""

    def __init__(self, start: float = 1_000.0, wall_start: float = 1_700_000_000.0) -> None:
        self._mono = start
        self._wall = wall_start

    def monotonic(self) -> float:
        return self._mono

    def wall(self) -> float:
        return self._wall

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("a clock does not run backwards")
        self._mono += seconds
        self._wall += seconds


class _JumpingSelector(selectors.BaseSelector):
    """A selector that, when nothing is ready, moves a ManualClock to the next timer instead
    of sleeping. Real I/O still wins: it first waits `patience` real seconds for some."""

    def __init__(self, clock: ManualClock, patience: float) -> None:
        self._real = selectors.DefaultSelector()
        self._clock = clock
        self._patience = patience

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.register(fileobj, events, data)

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._real.unregister(fileobj)

    def modify(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.modify(fileobj, events, data)

    def get_map(self) -> Mapping[Any, selectors.SelectorKey]:
        return self._real.get_map()

    def close(self) -> None:
        self._real.close()

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is not None and timeout <= 0:
            return self._real.select(0)
        ready = self._real.select(self._patience)
        if ready or timeout is None:
            return ready or self._real.select(None)
        self._clock.advance(timeout)
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop whose timers run on a ManualClock: `asyncio.sleep(60)`, a deadline or
    a park timeout passes as soon as nothing else is ready, and the clock the code under
    test reads has moved by exactly that much. For tests (trio's MockClock with autojump)."""

    def __init__(self, clock: ManualClock, patience: float = 0.01) -> None:
        super().__init__(_JumpingSelector(clock, patience))
        self._clock = clock

    def time(self) -> float:
        return self._clock.monotonic()


def run_in_virtual_time(clock: ManualClock, main: Coroutine[Any, Any, T]) -> T:
    """Run `main` to completion on a VirtualTimeLoop driven by `clock`."""
    loop = VirtualTimeLoop(clock)
    try:
        return loop.run_until_complete(main)
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
