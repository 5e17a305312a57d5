"""The accounting checker, short (issue 38, item 8; `make check-accounting` is the long run):
a site of three routers on Valkey with Sentinel, a PostgreSQL ledger, three agents and
simulators, twenty tenants, seeded mixed traffic through the official SDKs while a router,
the Valkey primary, PostgreSQL and an agent are killed; then every served token must be
billed once, the audit equal the ledger, no limit passed beyond its documented bound, and
nothing left held (tests/accounting/verify.py says how each is read)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.accounting.check import check

pytestmark = pytest.mark.timeout(200)

SEED = 38
REQUESTS = 240
WORKERS = 6


def test_every_served_token_is_billed_once_under_faults(tmp_path: Path) -> None:
    report = check(tmp_path, SEED, REQUESTS, WORKERS)
    print(report.text())
    assert not report.verdict.findings, report.text()
