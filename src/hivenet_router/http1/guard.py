"""Caps on open connections, per source and in all, for any listening socket.

A client that opens connections and never finishes a request must not be able to exhaust
the process's file descriptors. A source is an IPv4 address, or an IPv6 /56 (what one
customer is usually given). A refused connection is answered (when there is an answer to
give) and closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import time
from collections import Counter
from collections.abc import Callable

log = logging.getLogger("hivenet.http")

SUMMARY_INTERVAL = 60.0
MAX_LINGERING = 64
LINGER_SECONDS = 0.5


def address_prefix(peer: str) -> str:
    """IPv4 addresses count alone, IPv6 addresses by their /56."""
    try:
        address = ipaddress.ip_address(peer)
    except ValueError:
        return peer
    if address.version == 6:
        return str(ipaddress.ip_network(f"{address}/56", strict=False))
    return str(address)


def source_of(transport: asyncio.BaseTransport) -> str:
    peer = transport.get_extra_info("peername")
    return address_prefix(str(peer[0])) if peer else "unknown"


class ConnectionGuard:
    """Open connections by source prefix, with a cap per source and a total cap.

    `make_room`, when set, is asked for room when the total is reached: it may close a
    connection that costs nothing to lose (an idle keep-alive one), calling `leave` for
    it before it returns True."""

    def __init__(self, name: str, per_source: int, total: int) -> None:
        self.name = name
        self.per_source = per_source
        self.total = total
        self.make_room: Callable[[], bool] | None = None
        self.open = 0
        self.lingering = 0  # refused connections still delivering their answer
        self.refused_total = 0
        self._by_source: Counter[str] = Counter()
        self._refused = 0
        self._last_report = 0.0

    def enter(self, source: str) -> bool:
        if self._by_source[source] >= self.per_source or (
            self.open >= self.total and (self.make_room is None or not self.make_room())
        ):
            self._refused += 1
            self.refused_total += 1
            now = time.monotonic()
            if now - self._last_report >= SUMMARY_INTERVAL:
                log.warning(
                    "%s: refused %d connection(s) over the limits (%d per source, %d in all); "
                    "latest from %s",
                    self.name,
                    self._refused,
                    self.per_source,
                    self.total,
                    source,
                )
                self._refused, self._last_report = 0, now
            return False
        self.open += 1
        self._by_source[source] += 1
        return True

    def leave(self, source: str) -> None:
        self.open -= 1
        left = self._by_source[source] - 1
        if left > 0:
            self._by_source[source] = left
        else:
            del self._by_source[source]

    def from_source(self, source: str) -> int:
        return self._by_source.get(source, 0)

    def refuse(self, transport: asyncio.BaseTransport, answer: bytes) -> bool:
        """Answer a refused connection and close it. Closing a socket with unread request
        bytes makes the kernel send a reset that can overtake the answer, so a refused
        connection lingers briefly (its protocol discarding what it reads); only a few
        linger at once, the rest are reset at once. True if it lingers: the protocol must
        then call `lingered` when the connection is lost."""
        if not answer or self.lingering >= MAX_LINGERING:
            transport.abort()  # type: ignore[attr-defined]
            return False
        self.lingering += 1
        with contextlib.suppress(Exception):
            transport.write(answer)  # type: ignore[attr-defined]
        asyncio.get_running_loop().call_later(LINGER_SECONDS, transport.close)
        return True

    def lingered(self) -> None:
        self.lingering -= 1
