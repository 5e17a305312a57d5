from __future__ import annotations

import asyncio
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from hivenet_router.clock import ManualClock
from hivenet_router.storage.history import (
    DB_FILE,
    AgentHistory,
    SqliteHistory,
    StoreInUse,
    reset,
)


async def test_history_round_trip_and_expiry(tmp_path: Path) -> None:
    clock = ManualClock()
    store = SqliteHistory(tmp_path / "db", ttl_days=30, wall=clock.wall)
    await store.open()
    item = AgentHistory(
        "peer-a",
        successes=5,
        failures=1,
        input_tokens=10,
        output_tokens=20,
        disconnects=2,
        health_failures=1,
        srtt_ms=12.5,
        rttvar_ms=3.0,
    )
    await store.save([item, AgentHistory("peer-b", successes=1)])
    assert await store.load("peer-a") == item
    assert await store.load("nobody") is None
    await store.save([AgentHistory("peer-a", successes=6)])
    loaded = await store.load("peer-a")
    assert loaded is not None and loaded.successes == 6
    clock.advance(31 * 86400)
    assert await store.load("peer-a") is None  # expired
    await store.close()
    # WAL mode, and the rows are really on disk.
    with sqlite3.connect(tmp_path / "db" / DB_FILE) as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


async def test_records_survive_a_reopen_and_reset_removes_them(tmp_path: Path) -> None:
    store = SqliteHistory(tmp_path, ttl_days=0)
    await store.open()
    await store.save([AgentHistory("peer", failures=3)])
    await store.close()
    again = SqliteHistory(tmp_path, ttl_days=0)
    await again.open()
    loaded = await again.load("peer")
    assert loaded is not None and loaded.failures == 3
    await again.close()
    (tmp_path / "keep.txt").write_text("not ours")
    await asyncio.to_thread(reset, tmp_path)
    assert not (tmp_path / DB_FILE).exists()
    assert (tmp_path / "keep.txt").exists()  # reset deletes only the router's own files


async def test_daily_token_totals_persist_and_old_days_expire(tmp_path: Path) -> None:
    store = SqliteHistory(tmp_path, ttl_days=30)
    await store.open()
    await store.save_tokens("2026-11-28", {"old": 5})
    await store.save_tokens("2026-11-29", {"acme": 10})
    await store.save_tokens("2026-11-30", {"acme": 40, "beta\x00m": 7})
    assert await store.load_tokens("2026-11-30") == {"acme": 40, "beta\x00m": 7}
    assert await store.load_tokens("2026-11-29") == {"acme": 10}  # kept across midnight
    assert await store.load_tokens("2026-11-28") == {}  # older days are gone
    await store.close()


async def test_a_second_store_on_one_directory_is_refused(tmp_path: Path) -> None:
    first = SqliteHistory(tmp_path, ttl_days=30)
    await first.open()
    await first.save([AgentHistory("peer", successes=1000)])
    second = SqliteHistory(tmp_path, ttl_days=30)
    with pytest.raises(StoreInUse, match=f"pid {os.getpid()}"):
        await second.open()
    # Nor may a reset delete the database the first one has open.
    with pytest.raises(StoreInUse):
        await second.open(reset=True)
    await second.close()
    loaded = await first.load("peer")
    assert loaded is not None and loaded.successes == 1000
    await first.close()
    again = SqliteHistory(tmp_path, ttl_days=30)  # the lock goes with the store
    await again.open(reset=True)
    assert await again.load("peer") is None
    await again.close()


def test_another_live_process_holding_the_store_is_named(tmp_path: Path) -> None:
    with subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as holder:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "open"
        busy = SqliteHistory(tmp_path, ttl_days=30)
        with pytest.raises(StoreInUse, match=f"pid {holder.pid}"):
            asyncio.run(busy.open())
        asyncio.run(busy.close())
        # Leaving the block closes its input (it exits) and waits for it.
    # Its exit, however it ends, releases the lock.
    store = SqliteHistory(tmp_path, ttl_days=30)
    asyncio.run(store.open())
    asyncio.run(store.close())


# A child process that opens the store, says so, and holds it until its input closes.
HOLD = """
import asyncio, sys
from pathlib import Path
from hivenet_router.storage.history import SqliteHistory
async def main():
    store = SqliteHistory(Path(sys.argv[1]), ttl_days=30)
    await store.open()
    print("open", flush=True)
    await asyncio.to_thread(sys.stdin.read)
asyncio.run(main())
"""


async def test_a_store_path_that_is_a_file_fails_cleanly(tmp_path: Path) -> None:
    path = tmp_path / "file"
    path.write_text("")
    store = SqliteHistory(path, ttl_days=30)
    # OSError, which the router reports in one line; --reset-disk-db once raised from a
    # task instead.
    with pytest.raises(OSError):
        await store.open(reset=True)
    await store.close()
