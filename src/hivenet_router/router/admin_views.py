"""What the admin API (and the model catalog) say about agents and models, as JSON values.

Shapes follow the Go router's documented answers (its field names, so operators' scripts
and dashboards keep working); fields this router added before those were known stay beside
them. Pure functions of the live records: nothing here changes anything.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import msgspec

from hivenet_router.domain.agent import HardwareSnapshot
from hivenet_router.router.catalog import healthy, last_seen
from hivenet_router.router.registry import AgentRecord


def rfc3339(wall: float) -> str:
    """A Unix time as RFC 3339 in UTC, to the millisecond (`2026-08-11T09:30:00.123Z`)."""
    return datetime.fromtimestamp(wall, UTC).isoformat(timespec="milliseconds")[:-6] + "Z"


def _status(record: AgentRecord) -> dict[str, Any]:
    seen = record.last_seen_wall
    return {
        "healthy": healthy(record),
        "backend_healthy": record.backend_healthy,
        "active_requests": record.active,
        "capacity_utilization": record.load,
        "last_seen": rfc3339(seen) if seen is not None else None,
    }


def _universal(record: AgentRecord) -> dict[str, Any]:
    done = record.successes + record.failures
    return {
        "successful_requests_total": record.successes,
        "failed_requests_total": record.failures,
        "success_rate": record.successes / done if done else None,
        "input_tokens_total": record.input_tokens,
        "output_tokens_total": record.output_tokens,
        "rejected_requests_total": record.rejected,
        "disconnections_total": record.disconnects,
        "agent_failures_total": record.health_failures,
        "backend_failures_total": record.backend_failures,
        "srtt_ms": record.srtt_ms,
        "rttvar_ms": record.rttvar_ms,
        "latency_state": "UNKNOWN" if record.srtt_ms is None else "KNOWN",
    }


def _hardware(snapshot: HardwareSnapshot) -> dict[str, Any]:
    """The snapshot as the agent sent it, plus the Go router's grouping (gpu, cpu, memory)."""
    out: dict[str, Any] = msgspec.to_builtins(snapshot)
    gpus = []
    for position, gpu in enumerate(snapshot.gpus):
        free = gpu.vram_free_bytes
        if free is None and gpu.vram_total_bytes is not None and gpu.vram_used_bytes is not None:
            free = gpu.vram_total_bytes - gpu.vram_used_bytes
        gpus.append(
            {
                "index": gpu.index if gpu.index is not None else position,
                "util_percent": gpu.util_percent,
                "vram_used_bytes": gpu.vram_used_bytes,
                "vram_free_bytes": free,
                "vram_total_bytes": gpu.vram_total_bytes,
                "temperature_c": gpu.temperature_c,
                "power_watts": gpu.power_watts,
            }
        )
    out["gpu"] = gpus
    out["cpu"] = {"usage_percent": snapshot.cpu_usage_percent}
    out["memory"] = {
        "used_percent": snapshot.memory_used_percent,
        "available_bytes": snapshot.memory_available_bytes,
        "total_bytes": snapshot.memory_total_bytes,
    }
    return out


def routing_entry(record: AgentRecord, now: float) -> dict[str, Any]:
    """One agent of GET /admin/routing-table: the Go router's sections (metadata, status,
    universal, engine, hardware) and this router's own (health, history, ...)."""
    return {
        "peer_id": record.peer_id,
        "metadata": msgspec.to_builtins(record.reg),
        "status": _status(record),
        "universal": _universal(record),
        "health": {
            "connected": record.connected,
            "process_healthy": record.process_healthy,
            "backend_healthy": record.backend_healthy,
            "draining": record.draining,
            "stopping": record.stopping,
            "eligible": record.eligible,
            "seconds_since_heartbeat": round(now - record.last_heartbeat, 3),
        },
        "capacity": record.capacity,
        "active_requests": record.active,
        "history": {
            "successes": record.successes,
            "failures": record.failures,
            "consecutive_failures": record.consecutive_failures,
            "srtt_ms": record.srtt_ms,
            "rttvar_ms": record.rttvar_ms,
            "input_tokens": record.input_tokens,
            "output_tokens": record.output_tokens,
            "disconnects": record.disconnects,
            "health_failures": record.health_failures,
        },
        "engine": msgspec.to_builtins(record.engine) if record.engine else None,
        "hardware": _hardware(record.hardware) if record.hardware else None,
    }


def health_entry(record: AgentRecord) -> dict[str, Any]:
    """One agent of GET /admin/health."""
    reg = record.reg
    return {
        "peer_id": reg.peer_id,
        "model": reg.model,
        "engine": reg.engine,
        "version": reg.version,
        "capacity": reg.capacity,
        "region": reg.region,
        "is_healthy": healthy(record),
        "last_seen": last_seen(record),
    }
