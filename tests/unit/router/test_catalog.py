from __future__ import annotations

import orjson
import pytest

from hivenet_router.domain.errors import ApiError, ErrorCode, error_body
from hivenet_router.router.catalog import anthropic_model, anthropic_page


def _models(*ids: str) -> list[dict[str, object]]:
    return [{"id": i, "object": "model", "created": 0, "pretty_name": None} for i in ids]


def test_anthropic_model_shape() -> None:
    obj = anthropic_model({"id": "m", "created": 86400, "pretty_name": "Model M"})
    assert obj["type"] == "model"
    assert obj["display_name"] == "Model M"
    assert obj["created_at"] == "1970-01-02T00:00:00Z"


def test_anthropic_pages_forward_and_back() -> None:
    models = _models("a", "b", "c", "d", "e")
    first = anthropic_page(models, {"limit": "2"})
    assert [m["id"] for m in first["data"]] == ["a", "b"]  # type: ignore[attr-defined]
    assert first["has_more"] is True and first["last_id"] == "b"
    second = anthropic_page(models, {"limit": "2", "after_id": "b"})
    assert [m["id"] for m in second["data"]] == ["c", "d"]  # type: ignore[attr-defined]
    last = anthropic_page(models, {"limit": "2", "after_id": "d"})
    assert last["first_id"] == "e" and last["has_more"] is False
    back = anthropic_page(models, {"limit": "2", "before_id": "e"})
    assert [m["id"] for m in back["data"]] == ["c", "d"]  # type: ignore[attr-defined]
    assert back["has_more"] is True
    empty = anthropic_page([], {})
    assert empty == {"data": [], "first_id": None, "last_id": None, "has_more": False}


@pytest.mark.parametrize("limit", ["0", "1001", "ten"])
def test_anthropic_page_refuses_a_bad_limit(limit: str) -> None:
    with pytest.raises(ApiError) as caught:
        anthropic_page(_models("a"), {"limit": limit})
    assert caught.value.code is ErrorCode.INVALID_PARAMETER


def test_error_envelope_has_both_vendors_fields() -> None:
    body = orjson.loads(error_body(ErrorCode.MODEL_NOT_FOUND, "no", request_id="r1"))
    assert body["type"] == "error" and body["request_id"] == "r1"
    assert body["error"] == {
        "code": "model_not_found",
        "message": "no",
        "type": "not_found_error",
        "param": None,
        "source": "router",
    }
