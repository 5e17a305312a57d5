from __future__ import annotations

import asyncio
import errno
import logging
import socket
from collections.abc import Callable
from typing import Any

import pytest
import uvloop
from aiohttp import web
from aiohttp.http_exceptions import BadStatusLine

from hivenet_router.config.values import listen_address
from hivenet_router.listeners import (
    FD_RESERVE,
    PortCaps,
    QuietServerLog,
    raise_open_files_limit,
    share_descriptors,
    start_site,
)


def test_malformed_requests_are_summarised_not_traced(caplog: pytest.LogCaptureFixture) -> None:
    quiet = QuietServerLog("hivenet.test-http")
    with caplog.at_level(logging.DEBUG, "hivenet.test-http"):
        for _ in range(1000):
            quiet.exception("Error handling request", exc_info=BadStatusLine("junk"))
    assert len(caplog.records) == 1
    record = caplog.records[0]
    assert record.levelno == logging.INFO and record.exc_info is None
    assert "BadStatusLine" in record.getMessage()


def test_server_bugs_are_errors_with_a_traceback_once_a_minute(
    caplog: pytest.LogCaptureFixture,
) -> None:
    quiet = QuietServerLog("hivenet.test-http2")
    with caplog.at_level(logging.DEBUG, "hivenet.test-http2"):
        for _ in range(10):
            quiet.exception("Unhandled exception", exc_info=KeyError("bug"))
    assert len(caplog.records) == 1
    assert caplog.records[0].levelno == logging.ERROR and caplog.records[0].exc_info


WANTED = {
    "public": PortCaps(1024, 8192),
    "links": PortCaps(32, 4096),
    "pending": PortCaps(32, 256),
    "auth": PortCaps(8, 256, cost=3),
    "metrics": PortCaps(16, 64),
}


def test_caps_that_fit_the_open_files_limit_are_kept() -> None:
    caps, reserve = share_descriptors(1 << 20, WANTED)
    assert caps == WANTED and reserve == FD_RESERVE
    assert raise_open_files_limit() >= 1024


@pytest.mark.parametrize("open_files", [64, 1024, 4096, 20_000])
def test_at_a_low_limit_every_port_keeps_a_share_and_no_source_takes_one_whole(
    open_files: int,
) -> None:
    caps, reserve = share_descriptors(open_files, WANTED)
    used = sum(c.total * c.cost for c in caps.values())
    assert used + reserve <= open_files or all(c.total == 1 for c in caps.values())
    for name, c in caps.items():
        assert c.total >= 1 and 1 <= c.per_source <= c.total
        if c.total >= 8 and WANTED[name].per_source < WANTED[name].total:
            assert c.per_source < c.total  # one address never holds a whole port
    if open_files == 1024:
        # The case: 768 usable, and one address cannot hold the public port.
        assert reserve == FD_RESERVE and caps["public"].per_source <= caps["public"].total // 4


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


def _free_port() -> int:
    """A port free on both families (bound on the dual-stack wildcard, then released)."""
    family = socket.AF_INET6 if _ipv6_loopback() else socket.AF_INET
    with socket.socket(family) as probe:
        if family == socket.AF_INET6:
            probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        probe.bind(("", 0))
        return int(probe.getsockname()[1])


async def _answers(host: str, port: int) -> bool:
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError:
        return False
    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    head = await reader.readline()
    writer.close()
    await writer.wait_closed()
    return head.startswith(b"HTTP/1.1 200")


def _app() -> web.Application:
    async def hello(request: web.Request) -> web.Response:
        return web.Response(text="hi")

    app = web.Application()
    app.router.add_get("/", hello)
    return app


@pytest.mark.parametrize("new_loop", [asyncio.new_event_loop, uvloop.new_event_loop])
def test_an_empty_host_listens_on_both_families(new_loop: Callable[[], Any]) -> None:
    """`:PORT` (values.listen_address gives host "") once bound 0.0.0.0 only."""
    address = listen_address(f":{_free_port()}")

    async def main() -> None:
        # Two, as two --reuse-port routers of one host: each socket of each family shares.
        runners = [
            await start_site(_app(), address.host, address.port, reuse_port=True) for _ in range(2)
        ]
        try:
            assert await _answers("127.0.0.1", address.port)
            if _ipv6_loopback():
                assert await _answers("::1", address.port)
        finally:
            for runner in runners:
                await runner.cleanup()

    with asyncio.Runner(loop_factory=new_loop) as runner:
        runner.run(main())


async def test_an_empty_host_still_listens_where_ipv6_is_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A kernel without IPv6 refuses the socket itself; the event loop then skips that
    # family (uvloop does the same, in C: its socket factory cannot be patched here).
    real = socket.socket

    def no_ipv6(family: int = -1, *args: Any, **kwargs: Any) -> socket.socket:
        if family == socket.AF_INET6:
            raise OSError(errno.EAFNOSUPPORT, "Address family not supported by protocol")
        return real(family, *args, **kwargs)

    monkeypatch.setattr(socket, "socket", no_ipv6)
    port = _free_port()
    runner = await start_site(_app(), "", port)  # no OSError: the IPv4 socket alone
    try:
        assert await _answers("127.0.0.1", port)
    finally:
        await runner.cleanup()
