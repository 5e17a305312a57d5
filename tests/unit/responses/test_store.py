"""Stored responses, in SQLite and in PostgreSQL: per tenant, bounded by age (in virtual
time) and by size, surviving a restart."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from blockbuster import BlockBuster

from hivenet_router.domain.errors import ApiError, ErrorCode
from hivenet_router.responses.store import ResponseStore, SqliteResponses, Stored
from hivenet_router.responses.store_pg import PgResponses
from tests.postgres import Postgres, allow_connect_reads, postgres_server

Make = Callable[[float, int], ResponseStore]


def _response(rid: str, text: str = "x") -> dict[str, Any]:
    return {"id": rid, "output": [{"type": "message", "content": [{"text": text}]}]}


class Wall:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def server() -> Iterator[Postgres]:
    with postgres_server() as pg:
        yield pg


@pytest.fixture
def wall() -> Wall:
    return Wall()


@pytest.fixture(params=["sqlite", "postgres"])
def make(
    request: pytest.FixtureRequest, tmp_path: Path, wall: Wall, blockbuster: BlockBuster
) -> Make:
    if request.param == "sqlite":
        return lambda ttl, most: SqliteResponses(tmp_path, ttl, most, wall)
    allow_connect_reads(blockbuster)
    dsn = request.getfixturevalue("server").database()
    return lambda ttl, most: PgResponses(dsn, ttl, most, 5.0, wall)


async def test_tenants_ttl_and_delete(make: Make, wall: Wall) -> None:
    store = make(60.0, 1 << 20)
    await store.open()
    try:
        store.keep("a", _response("r1"), [{"id": "i1"}], [{"id": "h"}])
        assert (await store.get("a", "r1")) is not None  # visible before it is written
        assert await store.get("b", "r1") is None
        assert not await store.delete("b", "r1")
        await store.close()
        store = make(60.0, 1 << 20)
        await store.open()  # what was kept survives a restart
        found = await store.get("a", "r1")
        assert found is not None
        assert [i.get("id") for i in found.conversation()] == ["h", "i1", None]
        wall.now += 59.9
        assert await store.get("a", "r1") is not None
        wall.now += 0.1
        assert await store.get("a", "r1") is None
        store.keep("a", _response("r2"), [], [])
        assert await store.delete("a", "r2")  # waits for its write, then deletes it
        assert await store.get("a", "r2") is None
        await store.close()
        store = make(60.0, 1 << 20)
        await store.open()
        assert await store.get("a", "r2") is None
    finally:
        await store.close()


async def test_the_oldest_go_past_the_size_bound(make: Make, wall: Wall) -> None:
    store = make(3600.0, 2000)
    await store.open()
    try:
        for n in range(6):
            wall.now += 1
            store.keep("a", _response(f"r{n}", "y" * 400), [], [])
        await store.close()
        store = make(3600.0, 2000)
        await store.open()
        kept = [n for n in range(6) if await store.get("a", f"r{n}") is not None]
        # The newest stay, as many as fit 90 % of the bound (not one, not none).
        assert kept == list(range(6 - len(kept), 6)) and 1 < len(kept) < 6
    finally:
        await store.close()


async def test_postgres_down_at_start_then_back(
    server: Postgres, wall: Wall, blockbuster: BlockBuster
) -> None:
    """The router starts without its database (as the ledger does): reads are a 503 until
    it answers, and the table is made by the first call that reaches it."""
    allow_connect_reads(blockbuster)
    dsn = server.database()
    await asyncio.to_thread(server.kill)
    store = PgResponses(dsn, 60.0, 1 << 20, 1.0, wall)
    try:
        await store.open()  # does not raise
        with pytest.raises(ApiError) as down:
            await store.get("a", "r1")
        assert down.value.code is ErrorCode.BACKEND_UNAVAILABLE
        await asyncio.to_thread(server.start)
        store.keep("a", _response("r1"), [], [])
        assert await store.delete("a", "r1")
        assert await store.get("a", "r1") is None
    finally:
        await store.close()
        await asyncio.to_thread(server.start)  # returns at once when it runs


def test_a_record_is_the_same_bytes_from_the_response_json() -> None:
    """The Response's JSON its client was sent, handed to the store, makes the record
    byte for byte as serializing the whole record would."""
    response = {"id": "r1", "temperature": 1.0, "metadata": {"k": "\u00e9\n"}, "output": []}
    record = Stored("a", response, [{"id": "i1"}], [{"id": "h"}], 1234.5)
    expected = orjson.dumps(
        {"response": response, "items": record.items, "history": record.history, "created": 1234.5}
    )
    assert record.encode() == expected
    assert record.encode(orjson.dumps(response)) == expected
    assert Stored.decode("a", expected) == record
