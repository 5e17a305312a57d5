"""The cache key: one per request whatever its key order or spacing; the tenant in it unless
the cache is shared; what makes an answer repeatable; Cache-Control."""

from __future__ import annotations

from hivenet_router.gateway.cache_key import Directives, directives, repeatable, request_key

ROUTE = "/v1/chat/completions"


def key(body: bytes, tenant: str | None = "acme", route: str = ROUTE) -> str:
    found = request_key(route, "m", tenant, body)
    assert found is not None
    return found.digest


def test_key_order_and_whitespace_give_one_key() -> None:
    a = b'{"model":"m","temperature":0,"messages":[{"role":"user","content":"hi"}]}'
    b = b'{ "messages" : [ {"content":"hi", "role":"user"} ],\n "temperature": 0, "model":"m" }'
    assert key(a) == key(b)
    assert len(key(a)) == 64


def test_content_route_model_and_tenant_change_the_key() -> None:
    body = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'
    other = b'{"model":"m","messages":[{"role":"user","content":"hello"}]}'
    assert key(body) != key(other)
    assert key(body) != key(body, route="/v1/messages")
    assert key(body, "acme") != key(body, "other")
    assert request_key(ROUTE, "m", "acme", body) != request_key(ROUTE, "m2", "acme", body)


def test_a_shared_key_leaves_the_tenant_out() -> None:
    body = b'{"model":"m"}'
    assert key(body, None) == key(body, None)
    assert key(body, None) != key(body, "")  # no tenant differs from an empty tenant's


def test_answer_shaping_headers_are_in_the_key() -> None:
    body = b'{"model":"m"}'
    plain = request_key("/v1/messages", "m", "t", body, [("user-agent", "x")])
    beta = request_key("/v1/messages", "m", "t", body, [("anthropic-beta", "tools")])
    assert plain is not None and beta is not None
    assert plain.digest == key(body, "t", "/v1/messages")  # other headers are not
    assert plain.digest != beta.digest


def test_a_body_that_is_not_json_has_no_key() -> None:
    assert request_key(ROUTE, "m", "t", b"not json") is None


def test_repeatable_is_temperature_zero_or_a_seed() -> None:
    assert repeatable(ROUTE, {"temperature": 0})
    assert repeatable(ROUTE, {"temperature": 0.0})
    assert repeatable(ROUTE, {"temperature": 0.7, "seed": 3})
    assert not repeatable(ROUTE, {"temperature": 0.7})
    assert not repeatable(ROUTE, {})  # the default temperature samples
    assert not repeatable(ROUTE, {"seed": None, "temperature": False})
    assert repeatable("/v1/embeddings", {"input": "x"})  # not sampled at all
    found = request_key(ROUTE, "m", "t", b'{"temperature":1}')
    assert found is not None and not found.repeatable


def test_cache_control_directives() -> None:
    assert directives([]) == Directives()
    assert directives([("cache-control", "no-store")]).no_store
    got = directives([("cache-control", "No-Cache, max-age=30")])
    assert got.no_cache and got.max_age == 30 and not got.no_store
    assert directives([("cache-control", "max-age=0")]).no_cache
    assert directives([("cache-control", "private, max-age=oops")]) == Directives()
    assert directives([("x-cache-control", "no-store")]) == Directives()
