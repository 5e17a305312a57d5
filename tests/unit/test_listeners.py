from __future__ import annotations

import logging

import pytest
from aiohttp.http_exceptions import BadStatusLine

from hivenet_router.listeners import (
    FD_RESERVE,
    QuietServerLog,
    connection_budget,
    raise_open_files_limit,
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


def test_the_connection_budget_fits_the_open_files_limit() -> None:
    assert connection_budget(8192, 1024) == 1024 - FD_RESERVE
    assert connection_budget(100, 1 << 20) == 100
    assert raise_open_files_limit() >= 1024
