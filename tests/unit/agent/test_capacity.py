"""One backend proxy for every router: its in-flight count is the agent's total, it holds
the engine to --capacity when routers together send more, and it says when the agent turns
full or free (so every router hears at once)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
from aiohttp import web

from hivenet_router.agent.proxy import BackendProxy
from hivenet_router.http1.client import EngineClient
from hivenet_router.transport.link import INFERENCE_PROTOCOL, Stream, StreamReset
from tests.linkpair import Pair, link_pair

JSON = [("content-type", "application/json")]


@dataclass
class Engine:
    url: str = ""
    running: int = 0
    most: int = 0
    served: int = 0
    release: asyncio.Event = field(default_factory=asyncio.Event)


@pytest.fixture
async def engine() -> AsyncIterator[Engine]:
    """An engine that holds every request until the test releases them."""
    state = Engine()

    async def hold(request: web.Request) -> web.Response:
        state.running += 1
        state.most = max(state.most, state.running)
        try:
            await state.release.wait()
        finally:
            state.running -= 1
        state.served += 1
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", hold)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    state.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        yield state
    finally:
        state.release.set()
        await runner.cleanup()


async def send(pair: Pair) -> Stream:
    return await pair.client.open(INFERENCE_PROTOCOL, "POST", "/v1/chat/completions", JSON, b"{}")


async def until(condition: object) -> None:
    assert callable(condition)
    async with asyncio.timeout(5):
        while not condition():
            await asyncio.sleep(0.01)


async def test_two_routers_together_never_run_more_than_the_capacity(engine: Engine) -> None:
    client = EngineClient(engine.url)
    turns: list[bool] = []
    busy: list[int] = []
    proxy = BackendProxy(
        client,
        5.0,
        5.0,
        capacity=2,
        on_turn=lambda: turns.append(proxy.full),
        on_busy=lambda: busy.append(proxy.active),
    )
    try:
        async with (
            link_pair(INFERENCE_PROTOCOL, proxy.handle) as router_a,
            link_pair(INFERENCE_PROTOCOL, proxy.handle) as router_b,
        ):
            streams = [await send(router) for router in (router_a, router_b, router_a, router_b)]
            await until(lambda: proxy.active == 4 and engine.running == 2)
            assert turns == [True]  # full at its second request, said once
            # A request its router gave up on while it waited never reaches the engine.
            streams[3].reset(StreamReset("cancelled", "client went away"))
            await until(lambda: proxy.active == 3)
            engine.release.set()
            for stream in streams[:3]:
                assert (await stream.response_head()).status == 200
                await stream.read_all(4096)
            await until(lambda: proxy.active == 0)
    finally:
        await client.close()
    assert engine.most == 2 and engine.served == 3
    assert turns == [True, False]  # and free again once, when it dropped below
    assert busy == [1]  # idle to busy once: the monitor's cue to read the engine again


async def test_without_a_capacity_nothing_waits(engine: Engine) -> None:
    client = EngineClient(engine.url)
    proxy = BackendProxy(client, 5.0, 5.0)
    try:
        async with link_pair(INFERENCE_PROTOCOL, proxy.handle) as router:
            streams = [await send(router) for _ in range(3)]
            await until(lambda: engine.running == 3)
            assert not proxy.full
            engine.release.set()
            for stream in streams:
                assert (await stream.response_head()).status == 200
                await stream.read_all(4096)
    finally:
        await client.close()
