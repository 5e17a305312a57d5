"""What the agent's proxy hands the engine."""

from __future__ import annotations

from collections.abc import AsyncIterator

import orjson
import pytest
from aiohttp import web

from hivenet_router.agent.proxy import BackendProxy
from hivenet_router.http1.client import EngineClient
from hivenet_router.transport.link import INFERENCE_PROTOCOL
from tests.linkpair import link_pair


@pytest.fixture
async def engine() -> AsyncIterator[str]:
    """An engine that answers with the header names it was sent."""

    async def show(request: web.Request) -> web.Response:
        return web.json_response({"headers": sorted(k.lower() for k in request.headers)})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", show)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


async def test_the_engine_is_not_asked_to_compress_or_given_hop_headers(engine: str) -> None:
    client = EngineClient(engine)
    proxy = BackendProxy(client, 5.0, 5.0)
    headers = [
        ("content-type", "application/json"),
        ("accept-encoding", "gzip, br"),
        ("connection", "keep-alive, x-private"),
        ("te", "trailers"),
        ("x-trace", "1"),
    ]
    try:
        async with (
            link_pair(INFERENCE_PROTOCOL, proxy.handle) as pair,
            pair.client.request(
                INFERENCE_PROTOCOL, "POST", "/v1/chat/completions", headers, b"{}"
            ) as stream,
        ):
            head = await stream.response_head()
            assert head.status == 200
            seen = orjson.loads(await stream.read_all(4096))["headers"]
    finally:
        await client.close()
    assert "x-trace" in seen and "content-type" in seen
    assert "te" not in seen
    # A compressed answer would reach the router undecoded and its usage go uncounted.
    assert "accept-encoding" not in seen
