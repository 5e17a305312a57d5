"""Process plumbing shared by the three programs: event loop, logging, listeners, signals."""

from __future__ import annotations

import asyncio
import logging
import signal
import ssl
import sys
from collections.abc import Awaitable, Callable

import orjson
import uvloop
from aiohttp import web

from hivenet_router.listeners import ConnectionGuard, GuardedSite, QuietServerLog


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(entry).decode()


_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warn": logging.WARNING,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}


def setup_logging(level: str, fmt: str) -> None:
    """Configure the root logger. `level` takes `debug` or `router=debug,api=info` forms."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(_JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    for part in level.split(","):
        name, sep, value = part.strip().rpartition("=")
        target = logging.getLogger(f"hivenet.{name}") if sep else root
        target.setLevel(_LEVELS.get(value.strip().lower(), logging.INFO))
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


async def start_site(
    app: web.Application,
    host: str,
    port: int,
    *,
    ssl_context: ssl.SSLContext | None = None,
    reuse_port: bool = False,
    shutdown_timeout: float = 2.0,
    guard: ConnectionGuard | None = None,
    refusal: bytes = b"",
    idle_timeout: float = 75.0,
    handshake_timeout: float = 10.0,
) -> web.AppRunner:
    """Start serving `app`. Handlers are cancelled when their client goes away; on cleanup,
    in-flight requests get `shutdown_timeout` seconds to finish.

    `idle_timeout` closes a connection that has not delivered a complete request head that
    long after it was accepted or after its last answer. `guard` caps connections per source
    and in total; a refused connection gets `refusal` (if any) and is closed."""
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=shutdown_timeout,
        keepalive_timeout=idle_timeout,
        logger=QuietServerLog("hivenet.http"),
    )
    await runner.setup()
    site: web.TCPSite
    if guard is not None:
        site = GuardedSite(
            runner,
            host,
            port,
            guard=guard,
            refusal=refusal,
            handshake_timeout=handshake_timeout,
            ssl_context=ssl_context,
            reuse_port=reuse_port,
            backlog=1024,
        )
    else:
        site = web.TCPSite(
            runner, host, port, ssl_context=ssl_context, reuse_port=reuse_port, backlog=1024
        )
    await site.start()
    return runner


def run(main: Callable[[asyncio.Event], Awaitable[int]]) -> int:
    """Run `main(stop)` on uvloop; SIGINT and SIGTERM set `stop`. Returns the exit status."""

    async def wrapper() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        return await main(stop)

    return uvloop.run(wrapper())
