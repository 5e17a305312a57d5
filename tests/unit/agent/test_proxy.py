"""What the agent's proxy hands the engine."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from hivenet_router.agent.proxy import BackendProxy
from hivenet_router.http1.client import EngineClient
from tests.unit.agent.standin import engine, forward


@pytest.fixture
async def show_headers() -> AsyncIterator[str]:
    """An engine that answers with the header names it was sent."""

    async def show(request: web.Request) -> web.Response:
        return web.json_response({"headers": sorted(k.lower() for k in request.headers)})

    async with engine("POST", "/v1/chat/completions", show) as url:
        yield url


async def test_the_engine_is_not_asked_to_compress_or_given_hop_headers(
    show_headers: str,
) -> None:
    client = EngineClient(show_headers)
    proxy = BackendProxy(client, 5.0, 5.0)
    headers = [
        ("content-type", "application/json"),
        ("accept-encoding", "gzip, br"),
        ("connection", "keep-alive, x-private"),
        ("te", "trailers"),
        ("x-trace", "1"),
    ]
    try:
        seen = (await forward(proxy, headers))["headers"]
    finally:
        await client.close()
    assert "x-trace" in seen and "content-type" in seen
    assert "te" not in seen
    # A compressed answer would reach the router undecoded and its usage go uncounted.
    assert "accept-encoding" not in seen
