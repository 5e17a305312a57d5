"""Is this router's ID free in the site? Asked once at start, before anything is written.

Two live router processes under one router ID share its heartbeat, its credits and its
daily totals, and agents take them for one router. The one starting second finds the
other's heartbeat under its ID and refuses to start, naming the other. A heartbeat alone
does not make a live process: one left by a process of this router that just crashed stops
changing, and is waited out for the live window (three sync intervals, at least 3 s); one
that changes meanwhile is a live process's.
"""

from __future__ import annotations

import asyncio
from typing import Any

from hivenet_router.sync import store
from hivenet_router.sync.entries import Peer, read_heartbeats
from hivenet_router.sync.store import Keys


async def live_holder(client: Any, keys: Keys, router_id: str, window_ms: int) -> str | None:
    """The live process heartbeating under `router_id`, in words; None when there is none.
    Raises what the store raises (ValkeyError, OSError, TimeoutError, BadReply)."""
    poll = min(max(window_ms / 12_000, 0.05), 0.5)
    first = -1
    while True:
        now_ms, beat = await _own_beat(client, keys, router_id)
        peer = read_heartbeats({router_id.encode(): beat})[0].get(router_id) if beat else None
        if peer is None:
            return None
        if first < 0:
            first = peer.seen_ms
        elif peer.seen_ms != first:
            return describe(peer, now_ms)
        if now_ms - peer.seen_ms > window_ms:
            return None  # a previous process's last heartbeat: it is gone
        await asyncio.sleep(poll)


async def _own_beat(client: Any, keys: Keys, router_id: str) -> tuple[int, bytes | None]:
    """The store's time (ms) and the heartbeat under `router_id` (None when there is none)."""
    control = await store.control_node(client, keys)  # the store's time where beats are
    async with client.pipeline(transaction=False) as pipe:
        pipe.execute_command("TIME", **control)
        pipe.execute_command("HGET", keys.routers, router_id)
        clock, beat = await pipe.execute(raise_on_error=True)
    seconds, micros = store.as_list(clock, "TIME", 2)
    now_ms = store.as_int(seconds, "TIME") * 1000 + store.as_int(micros, "TIME") // 1000
    return now_ms, None if beat is None else store.as_bytes(beat, "heartbeat")


def describe(peer: Peer, now_ms: int) -> str:
    """Another router process as its heartbeat names it (a router before these fields
    names itself by its process's random ID only)."""
    info = peer.info
    parts = []
    if info.get("pid") is not None:
        parts.append(f"process {info['pid']} on host {info.get('host') or '?'}")
    if info.get("agents"):
        parts.append(f"agent port {info['agents']}")
    if info.get("addr"):
        parts.append(f"advertised as {info['addr']}")
    if not parts:
        parts.append(f"the router process {info.get('inc') or '?'}")
    age = max(0, now_ms - peer.seen_ms) / 1000
    return f"{', '.join(parts)} (its last heartbeat {age:.1f}s ago)"
