"""The model list in the two shapes clients expect.

OpenAI clients get `{"object": "list", "data": [...]}` with the router's extra fields
(replicas, capabilities). Anthropic clients, told apart by the `anthropic-version` header
their SDK always sends, get Anthropic's page (`data`, `first_id`, `last_id`, `has_more`)
with `before_id`, `after_id` and `limit` honoured, so `client.models.list()` works too.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from hivenet_router.domain.errors import ApiError, ErrorCode
from hivenet_router.router.registry import AgentRecord

ModelObject = dict[str, object]

_DEFAULT_LIMIT = 20
_MAX_LIMIT = 1000


def wants_anthropic(headers: Mapping[str, str]) -> bool:
    return "anthropic-version" in headers


def anthropic_model(obj: ModelObject) -> ModelObject:
    created = obj["created"]
    assert isinstance(created, int)
    return {
        "type": "model",
        "id": obj["id"],
        "display_name": obj.get("pretty_name") or obj["id"],
        "created_at": datetime.fromtimestamp(created, UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "capabilities": None,
        "max_input_tokens": None,
        "max_tokens": None,
    }


def _limit(query: Mapping[str, str]) -> int:
    raw = query.get("limit")
    if raw is None:
        return _DEFAULT_LIMIT
    try:
        limit = int(raw)
    except ValueError:
        limit = 0
    if not 1 <= limit <= _MAX_LIMIT:
        raise ApiError(ErrorCode.INVALID_PARAMETER, f"limit must be 1 to {_MAX_LIMIT}")
    return limit


def anthropic_page(objects: list[ModelObject], query: Mapping[str, str]) -> ModelObject:
    """One page of models sorted by ID, the way Anthropic's list endpoint pages."""
    limit = _limit(query)
    ids = [str(obj["id"]) for obj in objects]
    if "after_id" in query:
        start = ids.index(query["after_id"]) + 1 if query["after_id"] in ids else len(ids)
        page, more = objects[start : start + limit], start + limit < len(ids)
    elif "before_id" in query:
        end = ids.index(query["before_id"]) if query["before_id"] in ids else 0
        page, more = objects[max(0, end - limit) : end], end - limit > 0
    else:
        page, more = objects[:limit], limit < len(ids)
    data = [anthropic_model(obj) for obj in page]
    return {
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": more,
    }


def healthy(record: AgentRecord) -> bool:
    """Healthy as the router judges health: connected, heartbeating, backend up. Draining
    is a routing choice, not ill health (`eligible` says whether it takes requests)."""
    return record.connected and record.process_healthy and record.backend_healthy


def last_seen(record: AgentRecord) -> int | None:
    return int(record.last_seen_wall) if record.last_seen_wall is not None else None


def _catalog_entry(record: AgentRecord) -> dict[str, Any]:
    reg = record.reg
    return {
        "peer_id": reg.peer_id,
        "engine": reg.engine,
        "version": reg.version,
        "region": reg.region,
        "organization": reg.organization,
        "machine": reg.machine,
        "capacity": reg.capacity,
        "is_healthy": healthy(record),
        "last_seen": last_seen(record),
    }


def model_object(model: str, records: list[AgentRecord], *, detail: bool) -> dict[str, Any]:
    """A model as the catalog shows it (`/admin/models`; `/v1/models` likewise once the
    public handler uses it). Where agents disagree, the earliest registered non-empty value
    wins; `detail` adds one entry per agent (`agents.list`)."""
    ordered = sorted(records, key=lambda a: a.registered_at)
    regs = [a.reg for a in ordered]
    agents: dict[str, Any] = {
        "total": len(ordered),
        "healthy": sum(1 for a in ordered if healthy(a)),
        "total_capacity": sum(r.capacity for r in regs),
        "engines": sorted({r.engine for r in regs if r.engine}),
        "regions": sorted({r.region for r in regs if r.region}),
    }
    if detail:
        agents["list"] = [_catalog_entry(a) for a in ordered]
    pretty = next((r.llm_pretty_name for r in regs if r.llm_pretty_name), None)
    info = next((r.llm_info for r in regs if r.llm_info), None)
    return {
        "id": model,
        "object": "model",
        "created": int(ordered[0].registered_at) if ordered else 0,
        "owned_by": "hivenet-router",
        # Optional, as the reference has them: absent rather than null when no agent set
        # them (a client's `m.get("pretty_name", m["id"])` then reads the ID).
        **({"pretty_name": pretty} if pretty else {}),
        **({"info": info} if info else {}),
        "capability": next((r.capability for r in regs if r.capability), None),
        "capabilities": sorted({r.capability for r in regs}),
        "hide_llm": any(r.hide_llm for r in regs),
        "healthy_replicas": sum(1 for a in ordered if a.eligible),
        "agents": agents,
    }
