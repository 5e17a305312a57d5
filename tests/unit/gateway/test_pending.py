"""The local store of unbilled charges: kept once, oldest first, exact, across a reopen."""

from __future__ import annotations

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
