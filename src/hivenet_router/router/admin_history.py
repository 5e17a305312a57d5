"""The admin routes about agent history: what the store holds (GET /admin/storage) and the
metrics reset (POST /admin/metrics/reset)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Awaitable, Callable

import orjson

from hivenet_router.http1.messages import Answer, Request, Response
from hivenet_router.router.admin_views import rfc3339
from hivenet_router.router.history import HistoryKeeper
from hivenet_router.router.registry import Registry
from hivenet_router.storage.history import AgentHistory

log = logging.getLogger("hivenet.admin")

Handler = Callable[[Request], Awaitable[Answer]]


def _json(value: object, status: int = 200) -> Response:
    return Response(orjson.dumps(value), status)


def _go_duration(seconds: float) -> str:
    """An interval as Go prints a time.Duration ("30s", "1m30s", "200ms")."""
    if seconds < 1:
        return f"{seconds * 1000:g}ms"
    minutes, rest = divmod(seconds, 60)
    hours, minutes = divmod(int(minutes), 60)
    text = f"{rest:g}s"
    if minutes or hours:
        text = f"{minutes}m{text}"
    return f"{hours}h{text}" if hours else text


# What a metrics reset clears: exactly what the persistent store keeps for an agent.
_LIFETIME = tuple(f.name for f in dataclasses.fields(AgentHistory) if f.name != "peer_id")
_BLANK = AgentHistory(peer_id="")


class HistoryApi:
    def __init__(self, registry: Registry, history: HistoryKeeper) -> None:
        self.registry = registry
        self.history = history

    def routes(self) -> list[tuple[str, str, Handler]]:
        return [
            ("GET", "/admin/storage", self.storage),
            ("POST", "/admin/metrics/reset", self.metrics_reset),
        ]

    async def storage(self, request: Request) -> Response:
        """What the persistent store and the live records hold (the Go router's in-memory
        and on-disk databases)."""
        stats = await self.history.store.stats()
        if stats is None:
            return _json({"error": "storage stats not available for this backend"})
        agents = self.registry.all()
        return _json(
            {
                "mem_db": {
                    "metadata_count": len(agents),
                    "univ_punctual_count": len(agents),
                    "eng_punctual_count": sum(1 for a in agents if a.engine is not None),
                    "hardware_snapshot_count": sum(1 for a in agents if a.hardware is not None),
                },
                "disk_db": {
                    "backend": stats.backend,
                    "path": stats.path,
                    "univ_history_count": stats.history_records,
                    "quota_tpd_count": stats.quota_records,
                    "db_size_bytes": stats.file_bytes,
                    "wal_size_bytes": stats.wal_bytes,
                    "entry_ttl_days": stats.ttl_days,
                },
                # Old records expire each time history is flushed.
                "gc_interval": _go_duration(self.history.interval),
                "last_gc_at": rfc3339(stats.last_expiry) if stats.last_expiry else "never",
            }
        )

    async def metrics_reset(self, request: Request) -> Response:
        """Clear every agent's lifetime counters and latency history, live and on disk; the
        Prometheus series read them, so they restart from zero too."""
        for record in self.registry.all():
            for name in _LIFETIME:
                setattr(record, name, getattr(_BLANK, name))
        try:
            await self.history.store.clear()
        except Exception:
            log.exception("metrics reset: cannot clear the persisted agent history")
            return _json({"error": "cannot clear the persisted agent history"}, 500)
        log.warning("metrics reset: per-agent lifetime counters cleared")
        return _json(
            {
                "status": "metrics reset",
                "message": "per-agent lifetime counters cleared "
                "(disk, in-memory, and Prometheus series)",
            }
        )
