"""Which routers the agent keeps a session with: the bookkeeping of discovery, without I/O.

The agent starts from `--routers` (or `--router-grpc`): those entries are configured and
never closed. Every router of a site hands out the live routers of the site (in the
authentication answer and in every heartbeat reply); a listed router the agent has no
session with becomes a discovered entry, and its session is opened at once.

Routers of one site share the agent secret, so they share the key and peer ID the agent
pins: a router is recognised by its `router_id` together with that peer ID (a router too old
to send a router ID is known by the address it was dialled at). A router already reached
under another address (a DNS name in `--routers`, listed under its pod IP) gets no second
session: the router would replace one connection with the other, back and forth.

A discovered entry is closed once its router has been missing from every list for
`FORGET_AFTER` and its session is down, or at once when a configured entry reaches the same
router. A short or empty list (a router restarting) changes nothing.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from hivenet_router.config.values import ListenAddress, host_port

# How long a discovered router may be missing from every list, its session down, before
# its session is closed. A module constant so that tests can shorten it; not an option.
FORGET_AFTER = 120.0
# The most routers one list is read for: a site is a handful of routers.
MAX_LISTED = 256


@dataclass(frozen=True, slots=True)
class Listed:
    """One router as a list names it."""

    router_id: str
    peer_id: str
    addr: ListenAddress

    @property
    def identity(self) -> str:
        return identity(self.peer_id, self.router_id, self.addr)


def identity(peer_id: str, router_id: str, addr: ListenAddress) -> str:
    """What tells one router from another: its router ID with the (site-wide) peer ID, or
    the address it was reached at when it sends no router ID."""
    return f"{peer_id}/{router_id}" if router_id else f"{peer_id}@{addr}"


def parse_routers(raw: object) -> list[Listed]:
    """The `routers` of an authentication answer or heartbeat reply. Anything unusable (an
    item without an address, an address that is not HOST:PORT) is left out, never fatal."""
    if not isinstance(raw, list):
        return []
    found: list[Listed] = []
    for item in raw[:MAX_LISTED]:
        if not isinstance(item, dict):
            continue
        router_id, peer_id, addr = item.get("router_id"), item.get("peer_id"), item.get("addr")
        if not (isinstance(router_id, str) and isinstance(peer_id, str) and isinstance(addr, str)):
            continue
        try:
            address = host_port(addr)
        except ValueError:
            continue
        if address.port:
            found.append(Listed(router_id, peer_id, address))
    return found


class Verdict(enum.Enum):
    """What a session does once its router has answered and said who it is."""

    GO = "go"  # open the data connection and register
    STANDBY = "standby"  # another configured entry reaches this router: retry later
    CLOSE = "close"  # a discovered duplicate: the session ends


@dataclass(eq=False)
class Entry:
    id: int
    addr: ListenAddress  # where the session dials next
    configured: bool  # from --routers (or --router-grpc): never closed
    # The router it reaches: learnt when it authenticates; a discovered entry starts from
    # what its list said.
    identity: str = ""
    holding: bool = False  # its session got GO and is not down yet
    last_listed: float = 0.0
    moved_to: ListenAddress | None = None  # listed elsewhere; dialled there once down

    @property
    def name(self) -> str:
        router = self.identity.partition("/")[2] if "/" in self.identity else ""
        return f"{router} ({self.addr})" if router else str(self.addr)


class RouterBook:
    """The entries and the rules that open and close them. Callers pass the time in."""

    def __init__(self, configured: Iterable[ListenAddress]) -> None:
        self._entries: dict[int, Entry] = {}
        self._next = 0
        for addr in configured:
            self._add(addr, configured=True)

    @property
    def entries(self) -> list[Entry]:
        return list(self._entries.values())

    def get(self, entry_id: int) -> Entry | None:
        return self._entries.get(entry_id)

    def holding(self) -> int:
        """Sessions registered (or registering) with a router now."""
        return sum(1 for entry in self._entries.values() if entry.holding)

    def routers_up(self) -> list[str]:
        """The router IDs of the sessions that are up (a router without one is left out)."""
        return sorted(
            {
                router
                for entry in self._entries.values()
                if entry.holding and (router := entry.identity.partition("/")[2])
            }
        )

    def _add(self, addr: ListenAddress, *, configured: bool, ident: str = "") -> Entry:
        self._next += 1
        entry = Entry(self._next, addr, configured, ident)
        self._entries[entry.id] = entry
        return entry

    def _reaching(self, ident: str, besides: Entry | None = None) -> list[Entry]:
        return [e for e in self._entries.values() if e.identity == ident and e is not besides]

    def listed(self, routers: Sequence[Listed], now: float) -> list[Entry]:
        """A list from any router: the entries to open (routers no entry reaches yet)."""
        opened: list[Entry] = []
        for router in routers:
            known = self._reaching(router.identity)
            if known:
                for entry in known:
                    entry.last_listed = now
                    self._follow(entry, router.addr)
                continue
            if any(entry.addr == router.addr for entry in self._entries.values()):
                continue  # dialled there already; who answers is learnt when it does
            entry = self._add(router.addr, configured=False, ident=router.identity)
            entry.last_listed = now
            opened.append(entry)
        return opened

    @staticmethod
    def _follow(entry: Entry, addr: ListenAddress) -> None:
        """A discovered router listed under a new address is dialled there, once its
        session at the old one is down. A configured entry keeps its address."""
        if entry.configured or addr == entry.addr:
            entry.moved_to = None
        elif entry.holding:
            entry.moved_to = addr
        else:
            entry.addr, entry.moved_to = addr, None

    def reached(self, entry_id: int, ident: str) -> tuple[Verdict, list[Entry]]:
        """The entry's session authenticated with router `ident`: what it does now, and
        the entries to close (discovered duplicates of that router). A CLOSE verdict
        removes the entry itself."""
        entry = self._entries.get(entry_id)
        if entry is None:
            return Verdict.CLOSE, []
        entry.identity = ident
        others = self._reaching(ident, besides=entry)
        holder = next((other for other in others if other.holding), None)
        closing: list[Entry] = []
        if holder is not None and not (entry.configured and not holder.configured):
            if entry.configured:
                return Verdict.STANDBY, []
            del self._entries[entry.id]
            return Verdict.CLOSE, []
        # This entry takes the router: discovered duplicates go, configured ones stand by.
        for other in others:
            if not other.configured:
                del self._entries[other.id]
                closing.append(other)
        entry.holding = True
        return Verdict.GO, closing

    def holder(self, entry_id: int) -> Entry | None:
        """The other entry whose session holds the router this entry reached, if any."""
        entry = self._entries.get(entry_id)
        if entry is None or not entry.identity:
            return None
        return next((e for e in self._reaching(entry.identity, entry) if e.holding), None)

    def went_down(self, entry_id: int) -> None:
        entry = self._entries.get(entry_id)
        if entry is None:
            return
        entry.holding = False
        if entry.moved_to is not None:
            entry.addr, entry.moved_to = entry.moved_to, None

    def sweep(self, now: float) -> list[Entry]:
        """Close discovered entries whose router has been missing from every list for
        FORGET_AFTER while their session is down."""
        gone = [
            entry
            for entry in self._entries.values()
            if not entry.configured
            and not entry.holding
            and now - entry.last_listed >= FORGET_AFTER
        ]
        for entry in gone:
            del self._entries[entry.id]
        return gone
