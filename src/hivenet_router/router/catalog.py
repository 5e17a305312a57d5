"""The model list in the two shapes clients expect.

OpenAI clients get `{"object": "list", "data": [...]}` with the router's extra fields
(replicas, capabilities). Anthropic clients, told apart by the `anthropic-version` header
their SDK always sends, get Anthropic's page (`data`, `first_id`, `last_id`, `has_more`)
with `before_id`, `after_id` and `limit` honoured, so `client.models.list()` works too.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime

from hivenet_router.domain.errors import ApiError, ErrorCode

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
