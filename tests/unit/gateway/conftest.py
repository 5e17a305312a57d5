"""What the wallet tests share: a real PostgreSQL per test module, a fresh database per
test, and asyncpg's connect-time file reads let through the blocking-call guard."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from blockbuster import BlockBuster

from tests.postgres import Postgres, allow_connect_reads, postgres_server


@pytest.fixture
def _connect_reads(blockbuster: BlockBuster) -> None:
    allow_connect_reads(blockbuster)


@pytest.fixture(scope="module")
def server() -> Iterator[Postgres]:
    with postgres_server() as pg:
        yield pg


@pytest.fixture
def dsn(server: Postgres) -> str:
    return server.database()
