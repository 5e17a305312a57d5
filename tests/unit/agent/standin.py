"""What the agent's tests share: the parts of a serving agent, with no engine, and a
stand-in engine of one route."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import orjson
from aiohttp import web

from hivenet_router.agent.connection import Serving
from hivenet_router.agent.engines import adapter_for
from hivenet_router.agent.monitor import BackendMonitor, Pulse
from hivenet_router.agent.proxy import BackendProxy
from hivenet_router.config.agent import AgentConfig
from hivenet_router.http1.client import EngineClient
from hivenet_router.transport.identity import Identity
from hivenet_router.transport.link import INFERENCE_PROTOCOL
from hivenet_router.transport.tls import RouterTlsIdentity
from tests.linkpair import link_pair

SECRET = b"s" * 48


def serving(config: AgentConfig) -> Serving:
    """A serving agent whose backend address answers nothing (port 9)."""
    backend = EngineClient("http://127.0.0.1:9")
    return Serving(
        config=config,
        identity=Identity.generate(),
        tls=RouterTlsIdentity.from_secret(SECRET).client_context(),
        model="m",
        monitor=BackendMonitor(backend, adapter_for("vllm")),
        proxy=BackendProxy(backend, 1.0, 1.0),
        beats=Pulse(),
    )


@contextlib.asynccontextmanager
async def engine(method: str, path: str, handler: web.Handler) -> AsyncIterator[str]:
    """An HTTP server on loopback answering `method path` with `handler`; yields its URL."""
    app = web.Application()
    app.router.add_route(method, path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


async def forward(proxy: BackendProxy, headers: list[tuple[str, str]]) -> Any:
    """POST an empty JSON body through `proxy` over a link, as the router would; the JSON
    the engine answered (status 200 expected)."""
    async with (
        link_pair(INFERENCE_PROTOCOL, proxy.handle) as pair,
        pair.client.request(
            INFERENCE_PROTOCOL, "POST", "/v1/chat/completions", headers, b"{}"
        ) as stream,
    ):
        head = await stream.response_head()
        assert head.status == 200
        return orjson.loads(await stream.read_all(4096))
