from __future__ import annotations

import logging

import pytest
from aiohttp.http_exceptions import BadStatusLine

from hivenet_router.listeners import (
    FD_RESERVE,
    ConnectionGuard,
    QuietServerLog,
    address_prefix,
    connection_budget,
    raise_open_files_limit,
)


def test_the_guard_caps_each_source_and_the_total() -> None:
    guard = ConnectionGuard("test", per_source=2, total=3)
    assert guard.enter("a") and guard.enter("a")
    assert not guard.enter("a")  # per source
    assert guard.enter("b")
    assert not guard.enter("c")  # in total
    assert guard.open == 3 and guard.from_source("a") == 2
    guard.leave("a")
    assert guard.enter("c")
    for source in ("a", "b", "c"):
        guard.leave(source)
    assert guard.open == 0 and guard.from_source("a") == 0


def test_sources_are_ipv4_addresses_or_ipv6_56s() -> None:
    assert address_prefix("192.0.2.7") == "192.0.2.7"
    assert address_prefix("2001:db8:1:2:3::1") == address_prefix("2001:db8:1:2:ff::9")
    assert address_prefix("2001:db8:1:200::1") != address_prefix("2001:db8:1:100::1")


def test_refusals_are_logged_once_a_minute(caplog: pytest.LogCaptureFixture) -> None:
    guard = ConnectionGuard("test", per_source=1, total=10)
    assert guard.enter("a")
    with caplog.at_level(logging.WARNING, "hivenet.http"):
        for _ in range(500):
            assert not guard.enter("a")
    assert len(caplog.records) == 1


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


def test_the_connection_budget_fits_the_open_files_limit() -> None:
    assert connection_budget(8192, 1024) == 1024 - FD_RESERVE
    assert connection_budget(100, 1 << 20) == 100
    assert raise_open_files_limit() >= 1024
