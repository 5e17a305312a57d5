"""Moving agent history between live records and the persistent store."""

from __future__ import annotations

import logging

from hivenet_router.router.registry import AgentRecord, Registry
from hivenet_router.storage.history import HistoryStore

log = logging.getLogger("hivenet.storage")


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
