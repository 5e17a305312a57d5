"""Connection caps per source and in all."""

from __future__ import annotations

import logging

import pytest

from hivenet_router.http1.guard import ConnectionGuard, address_prefix


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
