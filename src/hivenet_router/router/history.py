"""Per-agent history kept on the hot path: outcomes and smoothed round-trip time.

SRTT and RTTVAR follow RFC 6298 (alpha 1/8, beta 1/4) over router-observed times from
forwarding a request to its answer's head.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from hivenet_router.storage.history import HistoryStore

if TYPE_CHECKING:
    from hivenet_router.router.registry import AgentRecord, Registry

log = logging.getLogger("hivenet.storage")

ALPHA = 1 / 8
BETA = 1 / 4


def smooth_rtt(srtt: float | None, rttvar: float | None, sample: float) -> tuple[float, float]:
    """Fold one round-trip sample (ms) into (SRTT, RTTVAR)."""
    if srtt is None or rttvar is None:
        return sample, sample / 2
    rttvar = (1 - BETA) * rttvar + BETA * abs(srtt - sample)
    srtt = (1 - ALPHA) * srtt + ALPHA * sample
    return srtt, rttvar


class HistoryKeeper:
    """Moves agent history between live records and the persistent store: restored when a
    known peer ID registers, flushed periodically, when an agent is removed and at
    shutdown. Per-request updates stay in memory."""

    def __init__(self, registry: Registry, store: HistoryStore, interval: float) -> None:
        self.registry = registry
        self.store = store
        self.interval = interval

    async def restore(self, record: AgentRecord) -> None:
        try:
            history = await self.store.load(record.peer_id)
        except Exception:
            log.exception("cannot read the history of agent %s", record.peer_id)
            return
        if history is not None and self.registry.get(record.peer_id) is record:
            record.restore(history)
            log.info(
                "agent %s resumes its history: %d ok, %d failed",
                record.peer_id,
                history.successes,
                history.failures,
            )

    async def flush(self, records: list[AgentRecord] | None = None) -> None:
        items = [r.history() for r in (self.registry.all() if records is None else records)]
        try:
            await self.store.save(items)
        except Exception:
            log.exception("cannot flush agent history (%d agents)", len(items))

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self.flush()
