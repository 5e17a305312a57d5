"""A transport wrapper that counts the writes reaching the socket (for the tests of
writes coalesced within one event-loop turn)."""

from __future__ import annotations

import asyncio


class CountingTransport:
    """Wraps a transport: `writes` holds what each `write` call carried."""

    def __init__(self, inner: asyncio.Transport) -> None:
        self.inner = inner
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(data)
        self.inner.write(data)

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)
