"""The admin routes about agent history: the metrics reset and the storage view."""

from __future__ import annotations

from pathlib import Path

import orjson

from hivenet_router.clock import ManualClock
from hivenet_router.domain.agent import Registration
from hivenet_router.http1.messages import Request, Response
from hivenet_router.router.admin_history import HistoryApi, _go_duration
from hivenet_router.router.history import HistoryKeeper
from hivenet_router.router.registry import AgentRecord, Registry
from hivenet_router.storage.history import AgentHistory, MemoryHistory, SqliteHistory


def request(method: str, path: str) -> Request:
    return Request(None, method, path, "", [], body=b"")


def agent(peer: str) -> AgentRecord:
    reg = Registration(peer_id=peer, model="m", capability="llm", engine="vllm", capacity=2)
    return AgentRecord(reg=reg, link=None, last_heartbeat=0.0, registered_at=0.0)


async def test_the_reset_clears_live_and_stored_history() -> None:
    registry, store = Registry(), MemoryHistory()
    live = agent("live")
    registry.upsert(live)
    live.finished(True, 120.0, None)
    live.finished(False, None, None)
    live.disconnects, live.health_failures, live.consecutive_failures = 2, 1, 1
    await store.save([live.history(), AgentHistory("away", successes=9)])
    api = HistoryApi(registry, HistoryKeeper(registry, store, 30.0))
    answer = await api.metrics_reset(request("POST", "/admin/metrics/reset"))
    assert isinstance(answer, Response) and answer.status == 200
    assert orjson.loads(answer.body)["status"] == "metrics reset"
    assert live.history() == AgentHistory("live")  # every persisted field back to its start
    assert live.consecutive_failures == 1  # a live routing signal, not history
    assert await store.load("away") is None and await store.load("live") is None


async def test_storage_describes_the_sqlite_store(tmp_path: Path) -> None:
    clock = ManualClock()
    registry = Registry()
    registry.upsert(agent("a"))
    store = SqliteHistory(tmp_path, ttl_days=30, wall=clock.wall)
    await store.open()
    try:
        await store.save([AgentHistory("a", successes=1)])
        api = HistoryApi(registry, HistoryKeeper(registry, store, 30.0))
        answer = await api.storage(request("GET", "/admin/storage"))
        assert isinstance(answer, Response)
        body = orjson.loads(answer.body)
    finally:
        await store.close()
    assert body["mem_db"] == {
        "metadata_count": 1,
        "univ_punctual_count": 1,
        "eng_punctual_count": 0,
        "hardware_snapshot_count": 0,
    }
    assert body["disk_db"]["univ_history_count"] == 1 and body["disk_db"]["entry_ttl_days"] == 30
    assert body["gc_interval"] == "30s" and body["last_gc_at"] == "2023-11-14T22:13:20.000Z"


async def test_storage_without_a_disk_store() -> None:
    registry = Registry()
    api = HistoryApi(registry, HistoryKeeper(registry, MemoryHistory(), 30.0))
    answer = await api.storage(request("GET", "/admin/storage"))
    assert isinstance(answer, Response) and answer.status == 200
    assert orjson.loads(answer.body) == {"error": "storage stats not available for this backend"}


def test_intervals_read_as_go_prints_them() -> None:
    assert [_go_duration(s) for s in (0.2, 5, 30, 90, 3600, 3725.5)] == [
        "200ms",
        "5s",
        "30s",
        "1m30s",
        "1h0m0s",
        "1h2m5.5s",
    ]
