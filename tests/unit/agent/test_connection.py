"""The routing signals one router session sends: after a new sample, only when routing
would notice the change, at most one per --routing-signal-interval."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import msgspec

from hivenet_router.agent.connection import RouterConnection
from hivenet_router.config.agent import AgentConfig
from hivenet_router.domain.agent import EngineSnapshot
from tests.unit.agent.standin import serving
from tests.unit.agent.test_reconnect import OneRouter


class SignalLink:
    """The session's Link as `_signals` uses it (`closed`, `call`): calls recorded with
    their times."""

    closed = False

    def __init__(self) -> None:
        self.sent: list[tuple[float, Any]] = []

    async def call(self, protocol: str, path: str, body: bytes, timeout: float) -> Any:
        assert path == "/routing-signals"
        self.sent.append((asyncio.get_running_loop().time(), msgspec.json.decode(body)))
        return 200, b"{}"


async def until(check: Callable[[], bool]) -> None:
    async with asyncio.timeout(5):
        while not check():
            await asyncio.sleep(0.005)


async def test_signals_follow_new_samples_that_change_what_routing_reads() -> None:
    interval = 0.2
    session = RouterConnection(
        1, OneRouter(), serving(AgentConfig(routing_signal_interval=interval)), lambda a: None
    )
    monitor = session.serving.monitor
    monitor.engine = EngineSnapshot(running_requests=0)
    monitor.sampled.notify()  # sampled before the link opened
    link = SignalLink()
    task = asyncio.create_task(session._signals(link))  # type: ignore[arg-type]  # a stand-in
    try:
        await until(lambda: len(link.sent) == 1)  # the first goes out at once
        assert link.sent[0][1]["engine"]["running_requests"] == 0
        await asyncio.sleep(interval * 1.5)
        monitor.sampled.notify()  # a new sample that changed nothing: no signal
        await asyncio.sleep(0.05)
        assert len(link.sent) == 1
        monitor.engine = EngineSnapshot(running_requests=3)
        monitor.sampled.notify()
        await until(lambda: len(link.sent) == 2)
        monitor.engine = EngineSnapshot(running_requests=5)
        monitor.sampled.notify()  # right after the last signal: waits out the interval
        await until(lambda: len(link.sent) == 3)
        assert link.sent[2][0] - link.sent[1][0] >= interval * 0.9
        assert link.sent[2][1]["engine"]["running_requests"] == 5
    finally:
        link.closed = True
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
