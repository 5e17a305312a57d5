"""CORS: preflights answered for allowed origins only, headers on the answers."""

from __future__ import annotations

import orjson

from hivenet_router.http1.messages import Request
from hivenet_router.router.cors import DEFAULT_HEADERS, Cors


def request(method: str, headers: list[tuple[str, str]]) -> Request:
    return Request(None, method, "/v1/chat/completions", "", headers, body=b"")


PREFLIGHT = [("origin", "https://app.example"), ("access-control-request-method", "POST")]


def test_a_preflight_from_an_allowed_origin() -> None:
    cors = Cors(("https://app.example",))
    asked = [*PREFLIGHT, ("access-control-request-headers", "authorization, content-type")]
    answer = cors.preflight(request("OPTIONS", asked), "rid-1")
    assert answer is not None
    assert answer.status == 204
    assert answer.headers["Access-Control-Allow-Origin"] == "https://app.example"
    assert answer.headers["Access-Control-Allow-Headers"] == "authorization, content-type"
    assert "POST" in answer.headers["Access-Control-Allow-Methods"]
    assert answer.headers["X-Request-ID"] == "rid-1"  # as every answer has


def test_a_huge_requested_header_list_is_not_echoed() -> None:
    cors = Cors(("*",))
    asked = [*PREFLIGHT, ("access-control-request-headers", "x" * 5000)]
    answer = cors.preflight(request("OPTIONS", asked), "rid-1")
    assert answer is not None
    assert answer.headers["Access-Control-Allow-Headers"] == DEFAULT_HEADERS


def test_a_preflight_from_another_origin_is_refused() -> None:
    cors = Cors(("https://app.example",))
    foreign = [("origin", "https://evil.example"), PREFLIGHT[1]]
    answer = cors.preflight(request("OPTIONS", foreign), "rid-1")
    assert answer is not None
    assert answer.status == 400
    body = orjson.loads(answer.body)
    assert body["error"]["code"] == "request_invalid" and body["request_id"] == "rid-1"
    assert answer.headers["X-Request-ID"] == "rid-1"
    assert "Access-Control-Allow-Origin" not in answer.headers


def test_only_preflights_are_answered_here() -> None:
    cors = Cors(("*",))
    assert cors.preflight(request("POST", PREFLIGHT), "rid-1") is None
    assert cors.preflight(request("OPTIONS", PREFLIGHT[:1]), "rid-1") is None


def test_answer_headers_for_allowed_origins_only() -> None:
    cors = Cors(("https://app.example",))
    allowed = cors.headers(request("POST", [("origin", "https://app.example")]))
    assert allowed["Access-Control-Allow-Origin"] == "https://app.example"
    exposed = allowed["Access-Control-Expose-Headers"].split(", ")
    # The headers a browser client needs to read: admission's bound, the cache, the rate.
    for header in ("X-Request-ID", "Retry-After", "X-Hivenet-Output-Bound", "X-Hivenet-Cache"):
        assert header in exposed
    assert cors.headers(request("POST", [("origin", "https://evil.example")])) == {}
    assert cors.headers(request("POST", [])) == {}
