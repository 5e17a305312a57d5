"""The local store of unbilled charges: kept once, oldest first, exact, across a reopen."""

from __future__ import annotations

import sqlite3
from decimal import Decimal
from pathlib import Path

from hivenet_router.gateway.pending import FILE_NAME, Charge, PendingStore


def charge(key: str, amount: str = "0.000123456789", record: bool = True) -> Charge:
    return Charge(key, f"req-{key}", "acme", "EUR", "m", Decimal(amount), 12, 34, record)


async def test_charges_are_kept_once_oldest_first_and_exactly(tmp_path: Path) -> None:
    store = PendingStore(tmp_path / "store")  # the folder is made on open
    try:
        assert await store.open() == 0
        await store.add([charge("a"), charge("b", "7", record=False)])
        await store.add([charge("a", "99"), charge("c")])  # "a" again: the first one stays
        assert store.count == 3
        taken = await store.take(2)
        assert taken == [charge("a"), charge("b", "7", record=False)]
        await store.remove([c.charge_id for c in taken])
        assert store.count == 1
        assert await store.take(10) == [charge("c")]
    finally:
        await store.close()


async def test_what_is_kept_survives_a_reopen(tmp_path: Path) -> None:
    first = PendingStore(tmp_path)
    await first.open()
    await first.add([charge("x", "1.5")])
    await first.close()
    assert (tmp_path / FILE_NAME).exists()
    second = PendingStore(tmp_path)
    try:
        assert await second.open() == 1
        assert await second.take(1) == [charge("x", "1.5")]
    finally:
        await second.close()


async def test_nothing_to_add_or_remove_touches_nothing(tmp_path: Path) -> None:
    store = PendingStore(tmp_path)
    try:
        await store.open()
        await store.add([])
        await store.remove([])
        assert store.count == 0 and await store.take(5) == []
    finally:
        await store.close()


async def test_dead_letters_are_kept_apart_and_never_taken(tmp_path: Path) -> None:
    store = PendingStore(tmp_path)
    try:
        await store.open()
        await store.add([charge("a"), charge("b"), charge("c")])
        await store.bury("b", "DataError: out of range")
        await store.add([charge("d")], dead="CharacterNotInRepertoireError")
        assert (store.count, store.dead) == (2, 2)
        assert [c.charge_id for c in await store.take(10)] == ["a", "c"]
        await store.remove(["a", "b"])  # "b" is a dead letter: not removed by a bill
        assert (store.count, store.dead) == (1, 2)
        letters = await store.dead_letters(10)
        assert [(c.charge_id, why) for c, why in letters] == [
            ("b", "DataError: out of range"),
            ("d", "CharacterNotInRepertoireError"),
        ]
    finally:
        await store.close()
    again = PendingStore(tmp_path)  # the counts are read back at the next start
    try:
        assert await again.open() == 1 and again.dead == 2
    finally:
        await again.close()


async def test_a_file_of_an_older_router_is_upgraded_in_place(tmp_path: Path) -> None:
    old = sqlite3.connect(tmp_path / FILE_NAME)
    old.execute(
        "CREATE TABLE pending (charge_id TEXT PRIMARY KEY, request_id TEXT NOT NULL,"
        " tenant TEXT NOT NULL, currency TEXT NOT NULL, model TEXT NOT NULL,"
        " amount TEXT NOT NULL, input_tokens INTEGER NOT NULL, output_tokens INTEGER NOT NULL,"
        " record INTEGER NOT NULL)"
    )
    old.execute("INSERT INTO pending VALUES ('x', 'req-x', 'acme', 'EUR', 'm', '1.5', 12, 34, 1)")
    old.commit()
    old.close()
    store = PendingStore(tmp_path)
    try:
        assert await store.open() == 1
        assert await store.take(5) == [charge("x", "1.5")]
    finally:
        await store.close()
