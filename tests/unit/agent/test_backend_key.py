"""The engine's API key (`--api-key` of vLLM, SGLang, llama.cpp): read once at start from
--backend-api-key-file or HIVENET_AGENT_BACKEND_API_KEY, sent as `Authorization: Bearer` on
forwarded requests (replacing any the request carried), and shown nowhere."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web

from hivenet_router.agent.proxy import BackendProxy
from hivenet_router.config.agent import AgentConfig, load_backend_api_key
from hivenet_router.config.options import ConfigError, describe, load
from hivenet_router.http1.client import EngineClient
from tests.unit.agent import standin

KEY = "sk-backend-3f9a1c7e"


def agent_config(argv: list[str], env: dict[str, str] | None = None) -> AgentConfig:
    return load(AgentConfig, argv, env or {}, "hivenet-agent")


def test_the_file_is_read_and_trailing_whitespace_dropped(tmp_path: Path) -> None:
    path = tmp_path / "backend.key"
    path.write_text(KEY + "\n \n")
    config = agent_config(["--backend-api-key-file", str(path)])
    assert load_backend_api_key(config) == KEY


def test_the_environment_variable(tmp_path: Path) -> None:
    config = agent_config([], {"HIVENET_AGENT_BACKEND_API_KEY": KEY})
    assert load_backend_api_key(config) == KEY
    path = tmp_path / "backend.key"
    path.write_text("from-the-file")
    both = agent_config(
        ["--backend-api-key-file", str(path)], {"HIVENET_AGENT_BACKEND_API_KEY": KEY}
    )
    assert load_backend_api_key(both) == "from-the-file"  # the file wins, as for the secret


def test_no_key_means_no_header() -> None:
    assert load_backend_api_key(agent_config([])) == ""


@pytest.mark.parametrize(
    ("content", "message"),
    [(None, "cannot read --backend-api-key-file"), ("  \n", "is empty")],
)
def test_a_missing_or_empty_file_stops_the_start(
    tmp_path: Path, content: str | None, message: str
) -> None:
    path = tmp_path / "backend.key"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=message) as info:
        load_backend_api_key(agent_config(["--backend-api-key-file", str(path)]))
    assert str(path) in str(info.value)


def test_a_key_that_cannot_travel_in_a_header_is_refused_without_showing_it(
    tmp_path: Path,
) -> None:
    path = tmp_path / "backend.key"
    path.write_text("sk-half\r\nX-Injected: sk-other")
    with pytest.raises(ConfigError, match="visible ASCII") as info:
        load_backend_api_key(agent_config(["--backend-api-key-file", str(path)]))
    assert "sk-" not in str(info.value)
    env = agent_config([], {"HIVENET_AGENT_BACKEND_API_KEY": "sk-ünïcode"})
    with pytest.raises(ConfigError, match="HIVENET_AGENT_BACKEND_API_KEY") as info:
        load_backend_api_key(env)
    assert "sk-" not in str(info.value)


def test_the_key_is_in_no_repr_or_banner() -> None:
    config = agent_config(
        [], {"HIVENET_AGENT_BACKEND_API_KEY": KEY, "HIVENET_ROUTER_JWT_SECRET": "jwt-" + KEY}
    )
    assert config.backend_api_key == KEY
    for shown in (repr(config), str(config), str(describe(config))):
        assert KEY not in shown
    assert "backend_api_key=" not in repr(config)
    assert describe(config)["HIVENET_AGENT_BACKEND_API_KEY"] == "<set>"


@pytest.fixture
async def engine() -> AsyncIterator[str]:
    """An engine that answers with the Authorization headers it was sent."""

    async def show(request: web.Request) -> web.Response:
        return web.json_response({"authorization": request.headers.getall("Authorization", [])})

    async with standin.engine("POST", "/v1/chat/completions", show) as url:
        yield url


@pytest.mark.parametrize(
    ("auth", "expected"),
    [
        ([("Authorization", f"Bearer {KEY}")], [f"Bearer {KEY}"]),
        ([], ["Bearer from-the-router"]),  # without a key, nothing is changed
    ],
)
async def test_forwarded_requests_carry_the_key_instead_of_any_other(
    engine: str, auth: list[tuple[str, str]], expected: list[str]
) -> None:
    client = EngineClient(engine)
    proxy = BackendProxy(client, 5.0, 5.0, auth=auth)
    headers = [("content-type", "application/json"), ("authorization", "Bearer from-the-router")]
    try:
        body = await standin.forward(proxy, headers)
    finally:
        await client.close()
    assert body == {"authorization": expected}
