"""What routers write about themselves in the store, written and read back in one place:
heartbeats ("server-ms info-json" per router ID) and usage entries (one per router and
round: rate spend per counter, daily changes per day). Anything malformed in another
router's writing is skipped and counted, never trusted."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from hivenet_router.sync.daily import DailyWrite


@dataclass(slots=True)
class Peer:
    router_id: str
    seen_ms: int  # server time of its last heartbeat
    info: dict[str, Any]


def read_heartbeats(beats: Mapping[bytes, bytes]) -> tuple[dict[str, Peer], int]:
    """Every heartbeat as a Peer, and how many were malformed (skipped)."""
    members: dict[str, Peer] = {}
    bad = 0
    for raw_id, raw in beats.items():
        stamp_text, _, info_text = raw.partition(b" ")
        if not stamp_text.isdigit():
            bad += 1
            continue
        router = raw_id.decode(errors="replace")
        try:
            info = orjson.loads(info_text) if info_text else {}
        except orjson.JSONDecodeError:
            info = {}
        members[router] = Peer(router, int(stamp_text), info if isinstance(info, dict) else {})
    return members, bad


def usage_entry(pending: dict[str, dict[str, float]], writes: list[DailyWrite]) -> bytes | None:
    """A round's usage entry; None when there is nothing to say."""
    usage: dict[str, Any] = {name: spent for name, spent in pending.items() if spent}
    daily: dict[str, dict[str, int]] = {}
    for write in writes:
        if write.delta:
            daily.setdefault(write.day, {})[write.key] = write.delta
    if daily:
        usage["d"] = daily
    return orjson.dumps(usage) if usage else None


class Spent(Protocol):
    def subtract(self, key: str, amount: float) -> None: ...


def apply_usage(
    raw: bytes,
    counters: Mapping[str, Spent],
    daily: Callable[[str, str, int], None] | None,
) -> bool:
    """Apply another router's usage entry: its rate spend to `counters`, its daily changes
    to `daily` (None: skip them). False when the entry is malformed."""
    try:
        usage = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return False
    if not isinstance(usage, dict):
        return False
    changes = usage.pop("d", None)
    well_formed = _apply_daily(changes, daily) if daily is not None else True
    for name, spent in usage.items():
        counter = counters.get(name)
        if counter is None or not isinstance(spent, dict):
            continue
        for key, amount in spent.items():
            if isinstance(amount, int | float) and math.isfinite(amount):
                counter.subtract(str(key), float(amount))
    return well_formed


def _apply_daily(changes: object, add: Callable[[str, str, int], None]) -> bool:
    if changes is None:
        return True
    if not isinstance(changes, dict):
        return False
    well_formed = True
    for day, keys in changes.items():
        if not isinstance(keys, dict):
            well_formed = False
            continue
        for key, delta in keys.items():
            if isinstance(delta, int) and not isinstance(delta, bool):
                add(str(day), str(key), delta)
    return well_formed
