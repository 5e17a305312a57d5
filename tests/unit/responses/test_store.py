"""Stored responses: per tenant, bounded by age (in virtual time) and by size."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hivenet_router.responses.store import ResponseStore


def _response(rid: str, text: str = "x") -> dict[str, Any]:
    return {"id": rid, "output": [{"type": "message", "content": [{"text": text}]}]}


class Wall:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_tenants_ttl_and_delete(tmp_path: Path) -> None:
    wall = Wall()
    store = ResponseStore(tmp_path, ttl=60.0, max_bytes=1 << 20, wall=wall)
    await store.open()
    try:
        store.keep("a", _response("r1"), [{"id": "i1"}], [{"id": "h"}])
        assert (await store.get("a", "r1")) is not None  # visible before it is written
        assert await store.get("b", "r1") is None
        assert not await store.delete("b", "r1")
        await store.close()
        store = ResponseStore(tmp_path, ttl=60.0, max_bytes=1 << 20, wall=wall)
        await store.open()  # what was kept survives a restart
        found = await store.get("a", "r1")
        assert found is not None
        assert [i.get("id") for i in found.conversation()] == ["h", "i1", None]
        wall.now += 59.9
        assert await store.get("a", "r1") is not None
        wall.now += 0.1
        assert await store.get("a", "r1") is None
        store.keep("a", _response("r2"), [], [])
        assert await store.delete("a", "r2")
        assert await store.get("a", "r2") is None
    finally:
        await store.close()


async def test_the_oldest_go_past_the_size_bound(tmp_path: Path) -> None:
    wall = Wall()
    store = ResponseStore(tmp_path, ttl=3600.0, max_bytes=2000, wall=wall)
    await store.open()
    try:
        for n in range(6):
            wall.now += 1
            store.keep("a", _response(f"r{n}", "y" * 400), [], [])
            await store.get("a", f"r{n}")
        await store.close()
        store = ResponseStore(tmp_path, ttl=3600.0, max_bytes=2000, wall=wall)
        await store.open()
        kept = [n for n in range(6) if await store.get("a", f"r{n}") is not None]
        assert kept and kept == list(range(6 - len(kept), 6)) and len(kept) < 6
    finally:
        await store.close()
