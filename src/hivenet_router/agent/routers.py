"""Every router of the site at once: one session per router (agent/connection.py), opened
and closed as discovery says (agent/discovery.py), over one shared engine, monitor and
backend proxy. A router that is down or refuses the agent affects only its own session."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from hivenet_router.agent import discovery
from hivenet_router.agent.connection import RouterConnection, Serving
from hivenet_router.agent.discovery import Entry, Listed, RouterBook, Verdict, identity
from hivenet_router.agent.session import RouterAuth, Session
from hivenet_router.config.values import ListenAddress

log = logging.getLogger("hivenet.agent")

# How often discovered routers are checked for closing (at most; less when FORGET_AFTER is
# shortened by a test).
SWEEP_INTERVAL = 5.0


class Routers:
    """The sessions of one agent, one per router it reaches."""

    def __init__(
        self,
        serving: Serving,
        dial: Callable[[ListenAddress], RouterAuth],
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.serving = serving
        self.book = RouterBook(serving.config.router_addresses)
        self._dial = dial
        self._clock = clock
        self._sleep = sleep
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._group: asyncio.TaskGroup | None = None
        self._twins: set[frozenset[int]] = set()  # pairs of entries warned about

    async def run(self) -> None:
        """Serve every router until cancelled."""
        async with asyncio.TaskGroup() as group:
            self._group = group
            for entry in self.book.entries:
                self._open(entry)
            group.create_task(self._sweep_forever())
            group.create_task(self._relay_health())

    def _open(self, entry: Entry) -> None:
        assert self._group is not None
        connection = RouterConnection(entry.id, self, self.serving, self._dial, self._sleep)
        task = self._group.create_task(connection.run(), name=f"router {entry.addr}")
        self._tasks[entry.id] = task
        task.add_done_callback(lambda _: self._forget(entry.id, task))

    def _forget(self, entry_id: int, task: asyncio.Task[None]) -> None:
        if self._tasks.get(entry_id) is task:
            del self._tasks[entry_id]

    def _close(self, entries: list[Entry], why: str) -> None:
        for entry in entries:
            log.info("closing the session with router %s: %s", entry.name, why)
            task = self._tasks.pop(entry.id, None)
            if task is not None:
                task.cancel()

    @property
    def open_sessions(self) -> int:
        return len(self._tasks)

    # -- what each session asks (connection.Site) -------------------------------------------

    def address(self, entry_id: int) -> ListenAddress | None:
        entry = self.book.get(entry_id)
        return entry.addr if entry is not None else None

    def reached(self, entry_id: int, session: Session) -> Verdict:
        entry = self.book.get(entry_id)
        if entry is None:
            return Verdict.CLOSE
        ident = identity(session.router_peer_id, session.router_id, entry.addr)
        verdict, closing = self.book.reached(entry_id, ident)
        self._close(closing, f"the same router is reached at {entry.addr}")
        if verdict is Verdict.STANDBY:
            self._warn_twin(entry, session.router_id)
        return verdict

    def _warn_twin(self, entry: Entry, router_id: str) -> None:
        """Two --routers entries answer as one router: one name of a router listed twice,
        or two routers under one router ID. The agent cannot tell them apart (every router
        of a site has the same key), so it registers with one only: said once, loudly."""
        holder = self.book.holder(entry.id)
        if holder is None:
            return
        pair = frozenset((entry.id, holder.id))
        if pair in self._twins:
            return  # one warning for the pair, whichever of them holds the session
        self._twins.add(pair)
        log.warning(
            "routers %s and %s both answer as router ID %r: this agent registers with the "
            "one at %s only. If they are two router processes, give each its own "
            "--router-id; if they are one router under two names, list it once in --routers",
            holder.addr,
            entry.addr,
            router_id,
            holder.addr,
        )

    def listed(self, routers: list[Listed]) -> None:
        for entry in self.book.listed(routers, self._clock()):
            log.info("router %s found through the site: opening a session", entry.name)
            self._open(entry)

    def released(self, entry_id: int) -> None:
        self.book.went_down(entry_id)

    def several(self) -> bool:
        return self.book.holding() > 1

    def routers_up(self) -> list[str]:
        return self.book.routers_up()

    # -- background -----------------------------------------------------------------------------

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(min(SWEEP_INTERVAL, discovery.FORGET_AFTER / 4))
            gone = self.book.sweep(self._clock())
            why = f"missing from the site's lists for {discovery.FORGET_AFTER:.0f}s, unreachable"
            self._close(gone, why)

    async def _relay_health(self) -> None:
        """Backend health flips wake every session's heartbeat."""
        monitor, beats = self.serving.monitor, self.serving.beats
        while True:
            await monitor.changed.wait()
            monitor.changed.clear()
            beats.notify()
