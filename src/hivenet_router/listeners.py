"""What guards a listening socket before any request handler runs.

A client that opens connections and never finishes a request must not be able to exhaust
the process's file descriptors, and a flood of malformed requests must not flood the log:

- `ConnectionGuard` (http1/guard.py) caps open connections per source (an IPv4 address,
  or an IPv6 /56, the same unit as the agent connection limit) and in total; the public
  API's own server (http1/server.py) applies it itself;
- `share_descriptors` splits the process's descriptor limit between the ports, so that
  no port can use what another one needs, and scales each port's caps to its share;
- `GuardedSite` applies a guard to every connection an aiohttp listener (the agent link,
  the metrics page, the simulator) accepts, and bounds the TLS handshake; on a TLS port
  the guard counts from the accept (`TlsGate`), before the handshake;
- `QuietServerLog` hears of malformed HTTP, from either server: counted and summarised at
  most once a minute instead of a traceback per request;
- `raise_open_files_limit` lifts the soft descriptor limit to the hard one at start.

On aiohttp listeners, time to first request and idle timeouts are aiohttp's keep-alive
timer (which runs from the moment a connection is accepted).
"""

from __future__ import annotations

import asyncio
import logging
import math
import resource
import ssl
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from hivenet_router.domain.errors import ErrorCode, error_body
from hivenet_router.http1.guard import ConnectionGuard, address_prefix, source_of
from hivenet_router.http1.tlsgate import TlsGate

__all__ = [
    "ConnectionGuard",
    "GuardedSite",
    "PortCaps",
    "QuietServerLog",
    "address_prefix",
    "share_descriptors",
]

log = logging.getLogger("hivenet.http")

SUMMARY_INTERVAL = 60.0
FD_RESERVE = 256  # descriptors kept for stores, providers, files, logs and child processes


class GuardedHandler(RequestHandler):
    """aiohttp's per-connection protocol, counted against a guard (refused before any byte
    is parsed when a cap is reached), answering protocol errors with the JSON envelope."""

    def __init__(
        self, manager: web.Server, guard: ConnectionGuard, refusal: bytes, **kwargs: Any
    ) -> None:
        super().__init__(manager, **kwargs)
        self._guard = guard
        self._refusal = refusal
        self._source: str | None = None
        self._lingering = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        source = source_of(transport)
        if not self._guard.enter(source):
            self._force_close = True  # aiohttp then ignores whatever the client sends
            self.transport = transport  # type: ignore[assignment]
            self._lingering = self._guard.refuse(transport, self._refusal)
            return
        self._source = source
        super().connection_made(transport)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._lingering:
            self._lingering = False
            self._guard.lingered()
        if self._source is None:
            return
        self._guard.leave(self._source)
        self._source = None
        super().connection_lost(exc)

    def eof_received(self) -> None:
        if self._source is None and self.transport is not None:
            self.transport.close()  # a refused client read its answer and hung up
            return
        super().eof_received()

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """A request aiohttp could not parse (bad request line, header too long, broken
        chunking): the same envelope as every other error, and the connection closes."""
        self.logger.exception("malformed request", exc_info=exc or True)
        if request.writer.output_size > 0:
            raise ConnectionError("answer already started; cannot send an error")
        code = ErrorCode.REQUEST_TOO_LARGE if status in (413, 431) else ErrorCode.REQUEST_INVALID
        if status >= 500:
            code = ErrorCode.BACKEND_ERROR
        text = "malformed HTTP request" if status < 500 else "internal router error"
        response = web.Response(
            status=status,
            body=error_body(code, text, status=status),
            content_type="application/json",
        )
        response.force_close()
        return response


class GuardedSite(web.TCPSite):
    """A TCP site whose connections pass a ConnectionGuard; TLS handshakes are bounded."""

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str,
        port: int,
        *,
        guard: ConnectionGuard,
        refusal: bytes = b"",
        handshake_timeout: float = 10.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(runner, host, port, **kwargs)
        self._guard = guard
        self._refusal = refusal
        self._handshake_timeout = handshake_timeout
        self.gate: TlsGate | None = None

    async def start(self) -> None:
        await web.BaseSite.start(self)
        server = self._runner.server
        assert server is not None
        loop = asyncio.get_running_loop()
        guard, refusal = self._guard, self._refusal
        # The options the runner was given (timeouts, the logger) go to each protocol, as
        # aiohttp's own Server.__call__ passes them.
        options = dict(server._kwargs)

        def factory() -> GuardedHandler:
            return GuardedHandler(server, guard, refusal, loop=loop, **options)

        protocols: Any = factory
        if self._ssl_context is not None:
            # Counted from the accept by the gate; a refused client is reset before TLS.
            self.gate = TlsGate(
                guard,
                self._ssl_context,
                lambda: RequestHandler(server, loop=loop, **options),
                self._handshake_timeout,
            )
            protocols = self.gate
        self._server = await loop.create_server(
            protocols,
            self._host,
            self._port,
            backlog=self._backlog,
            reuse_address=self._reuse_address,
            reuse_port=self._reuse_port,
        )


class QuietServerLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """The logger aiohttp's protocol writes to. A malformed request is the client's problem:
    it is counted and summarised once a minute at INFO, never logged with a traceback per
    request. Anything else aiohttp reports (a bug) is logged as an error, at most once a
    minute with its traceback."""

    def __init__(self, name: str) -> None:
        super().__init__(logging.getLogger(name), {})
        self._malformed = 0
        self._other = 0
        self._last: dict[str, float] = {}

    def _due(self, kind: str) -> bool:
        now = time.monotonic()
        if now - self._last.get(kind, -SUMMARY_INTERVAL) >= SUMMARY_INTERVAL:
            self._last[kind] = now
            return True
        return False

    def malformed(self, description: str) -> None:
        """Count one malformed or broken request; say so at most once a minute."""
        self._malformed += 1
        if self._due("malformed"):
            self.logger.info(
                "%d malformed or broken request(s) in the last minute (latest: %s)",
                self._malformed,
                description,
            )
            self._malformed = 0

    def exception(self, msg: object, *args: Any, exc_info: Any = True, **kwargs: Any) -> None:
        error = exc_info if isinstance(exc_info, BaseException) else None
        if error is None or _client_fault(error):
            self.malformed(_describe(error))
            return
        self._other += 1
        if self._due("other"):
            self.logger.error(
                "HTTP server error (%d in the last minute): %s",
                self._other,
                msg,
                exc_info=error,
            )
            self._other = 0


def _client_fault(error: BaseException) -> bool:
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, HttpProcessingError | ConnectionError | asyncio.CancelledError):
            return True
        if type(current).__name__ in {"RequestPayloadError", "ContentEncodingError"}:
            return True
        current = current.__cause__ or current.__context__
    return False


def _describe(error: BaseException | None) -> str:
    if error is None:
        return "unknown"
    text = str(error).replace("\n", " ").strip()
    return f"{type(error).__name__}: {text[:120]}"


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
    and in total; a refused connection gets `refusal` (if any) and is closed (on a TLS port
    it is reset before the handshake)."""
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


def gate_of(runner: web.AppRunner) -> TlsGate | None:
    """The gate counting a TLS site's connections (see `start_site`), if it has one."""
    for site in runner.sites:
        if isinstance(site, GuardedSite):
            return site.gate
    return None


def raise_open_files_limit() -> int:
    """Lift the soft limit on open files to the hard limit; return the limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return int(soft)


@dataclass(frozen=True, slots=True)
class PortCaps:
    """What one listening port may hold: connections per source and in all, and what
    each connection costs in descriptors (a relayed one holds more than its socket)."""

    per_source: int
    total: int
    cost: int = 1


def share_descriptors(
    open_files: int, wanted: dict[str, PortCaps]
) -> tuple[dict[str, PortCaps], int]:
    """Fit the ports' caps into the descriptor limit: (the caps in force, the reserve).

    A reserve (`FD_RESERVE`, or a quarter of a small limit) is kept for what is not a
    listening port's connection. When what the ports want does not fit in the rest, every
    port's total is scaled down by the same factor (at least one connection each), and its
    per-source cap with it, so that one source keeps the share of the port it was given:
    at a low limit a single address still cannot take a whole port."""
    reserve = min(FD_RESERVE, open_files // 4)
    usable = max(0, open_files - reserve)
    needed = sum(caps.total * caps.cost for caps in wanted.values())
    if needed <= usable:
        return dict(wanted), reserve
    factor = usable / needed
    fitted = {}
    for name, caps in wanted.items():
        total = max(1, math.floor(caps.total * factor))
        per_source = max(1, min(total, math.ceil(caps.per_source * total / caps.total)))
        fitted[name] = PortCaps(per_source, total, caps.cost)
    return fitted, reserve
