"""Listening ports for the processes tests start.

A port the kernel picks for `bind(0)` comes from the ephemeral range, the same range an
outgoing connection takes its local port from. Between the moment a test chooses such a
port and the moment the process it starts binds it, any connection on the machine may be
given it, and the process fails with "address already in use". Ports here come from below
that range, where no connection is ever given one, in turn from a random start, so two
choices in one run do not repeat until the whole span has been handed out.
"""

from __future__ import annotations

import itertools
import random
import socket
from pathlib import Path

LOOPBACK = "127.0.0.1"
LOWEST = 10000  # below it: well-known and registered services


def _span() -> tuple[int, int]:
    """[low, high): the ports below the ephemeral range, or an empty span if there are few."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return (0, 0)
    return (LOWEST, low) if low - LOWEST >= 1000 else (0, 0)


_LOW, _HIGH = _span()
_turn = itertools.count(random.randrange(max(_HIGH - _LOW, 1)))


def free_port() -> int:
    """A loopback TCP port nothing listens on now, and no outgoing connection can take."""
    size = _HIGH - _LOW
    for _ in range(size):
        port = _LOW + next(_turn) % size
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((LOOPBACK, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:  # no such span here
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])
