"""Ollama through its own `/api/tags`: health checks and model discovery, against a fake
Ollama on loopback (no Ollama is installed here) that answers what Ollama answers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web

from hivenet_router.agent.engines import adapter_for, ollama_models, openai_models
from hivenet_router.agent.monitor import BackendMonitor
from hivenet_router.http1.client import EngineClient


def tag(name: str) -> dict[str, Any]:
    """One entry of Ollama's `GET /api/tags` answer."""
    return {
        "name": name,
        "model": name,
        "modified_at": "2025-05-04T17:37:44.706015396-07:00",
        "size": 4683075271,
        "digest": "a2af6cc3eb7fa8be8504abaf9b04e88f17a119ec3f04a3addf55f92841195f5a",
        "details": {"format": "gguf", "family": "llama", "parameter_size": "8.0B"},
    }


@dataclass
class FakeOllama:
    models: list[dict[str, Any]]
    status: int = 200
    seen: list[tuple[str, str | None]] = field(default_factory=list)
    url: str = ""
    pull: list[dict[str, Any]] = field(default_factory=list)  # listed from the 3rd request on

    async def tags(self, request: web.Request) -> web.Response:
        self.seen.append((request.path, request.headers.get("Authorization")))
        if self.pull and len(self.seen) == 3:
            self.models = self.pull
        if self.status != 200:
            return web.json_response({"error": "boom"}, status=self.status)
        return web.json_response({"models": self.models})

    async def elsewhere(self, request: web.Request) -> web.Response:
        self.seen.append((request.path, request.headers.get("Authorization")))
        return web.json_response({"error": "not this"}, status=404)


@pytest.fixture
async def ollama() -> AsyncIterator[FakeOllama]:
    fake = FakeOllama([tag("llama3:8b")])
    app = web.Application()
    app.router.add_get("/api/tags", fake.tags)
    app.router.add_get("/{tail:.*}", fake.elsewhere)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    fake.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        yield fake
    finally:
        await runner.cleanup()


async def test_health_is_checked_on_api_tags(ollama: FakeOllama) -> None:
    client = EngineClient(ollama.url)
    monitor = BackendMonitor(client, adapter_for("ollama"))
    try:
        assert await monitor.probe()
        ollama.status = 500
        assert not await monitor.probe()
    finally:
        await client.close()
    assert [path for path, _ in ollama.seen] == ["/api/tags", "/api/tags"]


async def test_the_model_is_discovered_from_api_tags(ollama: FakeOllama) -> None:
    ollama.models = [tag("llama3:8b"), tag("mistral:7b")]
    client = EngineClient(ollama.url)
    monitor = BackendMonitor(client, adapter_for("ollama"))
    try:
        async with asyncio.timeout(10):
            assert await monitor.discover_model(0.01) == "llama3:8b"  # the first listed
    finally:
        await client.close()
    assert [path for path, _ in ollama.seen] == ["/api/tags"]


async def test_discovery_waits_for_a_pulled_model(ollama: FakeOllama) -> None:
    ollama.models = []
    ollama.pull = [tag("llama3.1:latest")]
    client = EngineClient(ollama.url)
    monitor = BackendMonitor(client, adapter_for("ollama"))
    try:
        async with asyncio.timeout(10):
            assert await monitor.discover_model(0.01) == "llama3.1"  # implicit :latest dropped
    finally:
        await client.close()
    assert len(ollama.seen) == 3


async def test_the_backend_key_reaches_ollama_too(ollama: FakeOllama) -> None:
    client = EngineClient(ollama.url)
    monitor = BackendMonitor(
        client, adapter_for("ollama"), auth=[("Authorization", "Bearer k-123")]
    )
    try:
        assert await monitor.probe()
        async with asyncio.timeout(10):
            assert await monitor.discover_model(0.01) == "llama3:8b"
    finally:
        await client.close()
    assert ollama.seen == [("/api/tags", "Bearer k-123")] * 2


def test_tag_names() -> None:
    raw = (
        b'{"models":[{"name":"llama3.1:latest","model":"llama3.1:latest"},'
        b'{"name":"mistral:7b"},{"model":"qwen3:4b"},{"size":1},"junk"]}'
    )
    assert ollama_models(raw) == ["llama3.1", "mistral:7b", "qwen3:4b"]
    assert ollama_models(b'{"models":null}') == []
    assert ollama_models(b"[]") == []
    with pytest.raises(ValueError):
        ollama_models(b"<html>")


def test_other_engines_still_discover_through_v1_models() -> None:
    for engine in ("vllm", "sglang", "llamacpp", "infinity", "custom", "openai"):
        assert adapter_for(engine).models_path() == "/v1/models"
    assert adapter_for("ollama").models_path() == adapter_for("ollama").health_path()
    raw = b'{"object":"list","data":[{"id":"a"},{"id":""},{"x":1},{"id":"b"}]}'
    assert openai_models(raw) == ["a", "b"]
