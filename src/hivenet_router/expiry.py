"""A deadline for the running task, for the request path.

`asyncio.timeout` runs five or six Python-level steps per use (the manager, its enter and
exit, `current_task`, the reschedule); the router and the agent each enter one per
request. `Expiry` does the same job with one object and one loop timer:

    expiry = Expiry(deadline)        # loop time; cancels this task when it passes
    try:
        ...                          # awaits
    except asyncio.CancelledError:
        if expiry.caused():          # it was the deadline: the cancel is withdrawn
            raise TimeoutError from None
        raise
    finally:
        expiry.cancel()

As with `asyncio.timeout`, a cancel from anywhere else stays a cancel, and a deadline
already past cancels at the next turn of the loop.
"""

from __future__ import annotations

import asyncio


class Expiry:
    __slots__ = ("_cancelling", "_handle", "_task", "fired")

    def __init__(self, when: float | None) -> None:
        """`when` in the loop's time; None for no deadline at all."""
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("Expiry needs a running task")
        self._task = task
        self._cancelling = task.cancelling()
        self.fired = False
        self._handle = None if when is None else task.get_loop().call_at(when, self._fire)

    @classmethod
    def after(cls, seconds: float | None) -> Expiry:
        """A deadline `seconds` from now (None or 0: none)."""
        if not seconds:
            return cls(None)
        return cls(asyncio.get_running_loop().time() + seconds)

    def _fire(self) -> None:
        self.fired = True
        self._task.cancel()

    def cancel(self) -> None:
        """The guarded work is over (however it ended): the deadline no longer applies."""
        if self._handle is not None:
            self._handle.cancel()

    def caused(self) -> bool:
        """Called with a CancelledError in hand: True when the deadline cancelled the task
        (and nothing else did), in which case that cancel is withdrawn."""
        return self.fired and self._task.uncancel() <= self._cancelling
