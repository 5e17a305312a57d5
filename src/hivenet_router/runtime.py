"""Process plumbing shared by the three programs: event loop, logging, signals. (Listeners
are in listeners.py, which the agent never imports.)"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import sys
from collections.abc import Awaitable, Callable

import orjson
import uvloop

from hivenet_router.config.values import LOG_LEVELS


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


def setup_logging(level: str, fmt: str) -> None:
    """Configure the root logger. `level` takes `debug` or `router=debug,api=info` forms;
    an unknown level raises ValueError (it once meant info, silently)."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(_JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    for part in level.split(","):
        if not part.strip():
            continue
        name, sep, value = part.strip().rpartition("=")
        number = LOG_LEVELS.get(value.strip().lower())
        if number is None:
            raise ValueError(
                f"unknown log level {value.strip()!r} (use debug, info, warn or error)"
            )
        target = logging.getLogger(f"hivenet.{name.strip()}") if sep else root
        target.setLevel(number)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def run(main: Callable[[asyncio.Event], Awaitable[int]]) -> int:
    """Run `main(stop)` on uvloop; SIGINT and SIGTERM set `stop`. Returns the exit status."""

    async def wrapper() -> int:
        # What was built at start lives as long as the process: keep it out of every
        # future collection's scan.
        gc.collect()
        gc.freeze()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        return await main(stop)

    return uvloop.run(wrapper())
