"""The simulator's fault admin routes, /metrics and error answers, served in process."""

from __future__ import annotations

from collections.abc import AsyncIterator

import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from hivenet_router.config.options import ConfigError, load
from hivenet_router.config.sim import SimConfig
from hivenet_router.domain.classify import classify
from hivenet_router.domain.errors import ErrorCode
from hivenet_router.sim.server import Simulator

Client = TestClient[web.Request, web.Application]


async def serve(simulator: Simulator) -> Client:
    client: Client = TestClient(TestServer(simulator.app()))
    await client.start_server()
    return client


@pytest.fixture
async def client() -> AsyncIterator[Client]:
    client = await serve(Simulator(SimConfig(kv_cache_tokens=1000, block_size=16)))
    try:
        yield client
    finally:
        await client.close()


async def test_slowdown_is_set_at_run_time_and_shown(client: Client) -> None:
    assert (await (await client.get("/admin/faults")).json())["slowdown"] == 1.0
    reply = await client.post("/admin/faults", json={"slowdown": 3})
    assert reply.status == 200 and (await reply.json())["slowdown"] == 3.0
    assert (await (await client.get("/admin/faults")).json())["slowdown"] == 3.0


@pytest.mark.parametrize("bad", [0.5, "x", -1, 0, None])
async def test_slowdown_refuses_what_is_no_factor(client: Client, bad: object) -> None:
    reply = await client.post("/admin/faults", json={"slowdown": bad})
    assert reply.status == 400
    assert "slowdown" in (await reply.json())["error"]["message"]
    assert (await (await client.get("/admin/faults")).json())["slowdown"] == 1.0


def test_slowdown_flag_reaches_the_engine() -> None:
    simulator = Simulator(load(SimConfig, ["--fault-slowdown", "2.5"], {}, "hivenet-sim"))
    assert simulator.faults.as_dict()["slowdown"] == 2.5
    assert simulator.engine.faults is simulator.faults  # admin changes reach the engine
    assert load(SimConfig, [], {}, "hivenet-sim").fault_slowdown == 1.0
    for bad in ("0.5", "x", "-1", "inf", "nan"):
        with pytest.raises(ConfigError, match="--fault-slowdown"):
            load(SimConfig, ["--fault-slowdown", bad], {}, "hivenet-sim")


async def test_metrics_carry_the_cache_config(client: Client) -> None:
    text = await (await client.get("/metrics")).text()
    lines = [line for line in text.splitlines() if line.startswith("vllm:cache_config_info{")]
    assert len(lines) == 1
    assert 'block_size="16"' in lines[0] and 'num_gpu_blocks="62"' in lines[0]  # 1000 // 16
    assert 'enable_prefix_caching="True"' in lines[0]
    assert lines[0].endswith("} 1.0")
    assert "# TYPE vllm:cache_config_info gauge" in text


HI = [{"role": "user", "content": "hi"}]


@pytest.fixture
async def quick() -> AsyncIterator[Client]:
    client = await serve(Simulator(SimConfig(zero_latency=True)))
    try:
        yield client
    finally:
        await client.close()


def _anthropic_error(body: object, kind: str) -> str:
    """The message of an Anthropic-shaped error body of type `kind`."""
    assert isinstance(body, dict) and body.get("type") == "error", body
    error = body["error"]
    assert set(error) == {"type", "message"} and error["type"] == kind, body
    message = error["message"]
    assert isinstance(message, str) and not message.startswith("{"), body
    return message


@pytest.mark.parametrize(
    ("path", "body", "status", "kind", "words"),
    [
        ("/v1/messages", {"max_tokens": 0, "messages": HI}, 400, "invalid_request_error", "max_"),
        (
            "/v1/messages",
            {"max_tokens": True, "messages": HI},
            400,
            "invalid_request_error",
            "max_",
        ),
        ("/v1/messages", {"max_tokens": -3, "messages": HI}, 400, "invalid_request_error", "max_"),
        ("/v1/messages", {"max_tokens": 5}, 400, "invalid_request_error", "messages"),
        (
            "/v1/messages",
            {"model": "x", "max_tokens": 5, "messages": HI},
            404,
            "not_found_error",
            "`x`",
        ),
        (
            "/v1/messages/count_tokens",
            {"model": "x", "messages": HI},
            404,
            "not_found_error",
            "`x`",
        ),
        ("/v1/messages", [1], 400, "invalid_request_error", "JSON object"),
        ("/v1/messages/count_tokens", [1], 400, "invalid_request_error", "JSON object"),
    ],
)
async def test_anthropic_routes_answer_errors_in_anthropic_shape(
    quick: Client, path: str, body: object, status: int, kind: str, words: str
) -> None:
    if isinstance(body, dict):
        body = {"model": "sim-model", **body}
    reply = await quick.post(path, json=body)
    assert reply.status == status
    assert words in _anthropic_error(await reply.json(), kind)


async def test_anthropic_routes_answer_bad_json_in_anthropic_shape(quick: Client) -> None:
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        reply = await quick.post(path, data=b"{", headers={"Content-Type": "application/json"})
        assert reply.status == 400
        assert "invalid JSON" in _anthropic_error(await reply.json(), "invalid_request_error")


async def test_the_error_fault_is_anthropic_shaped_on_messages(quick: Client) -> None:
    assert (await quick.post("/admin/faults", json={"error_rate": 1.0})).status == 200
    body = {"model": "sim-model", "max_tokens": 5, "messages": HI}
    for stream in (False, True):
        reply = await quick.post("/v1/messages", json={**body, "stream": stream})
        assert reply.status == 500
        assert _anthropic_error(await reply.json(), "api_error") == "simulated engine failure"
    # OpenAI routes keep vLLM's shape.
    reply = await quick.post(
        "/v1/chat/completions", json={k: body[k] for k in ("model", "messages")}
    )
    assert reply.status == 500
    assert (await reply.json())["error"]["type"] == "InternalServerError"


async def test_openai_routes_keep_openai_error_shape(quick: Client) -> None:
    reply = await quick.post("/v1/chat/completions", json={"model": "x", "messages": HI})
    assert reply.status == 404
    assert (await reply.json())["error"]["type"] == "NotFoundError"
    reply = await quick.post(
        "/v1/chat/completions", json={"model": "sim-model", "messages": HI, "max_tokens": 0}
    )
    assert reply.status == 400
    assert (await reply.json())["error"]["type"] == "BadRequestError"


@pytest.mark.parametrize(
    "limits",
    [
        {"max_tokens": 3},
        {"max_tokens": 3, "max_completion_tokens": None},
        {"max_tokens": None, "max_completion_tokens": 3},
        {"max_completion_tokens": 3},
    ],
)
async def test_a_null_token_limit_counts_as_absent(
    quick: Client, limits: dict[str, object]
) -> None:
    body = {"model": "sim-model", "messages": HI, **limits}
    answer = await (await quick.post("/v1/chat/completions", json=body)).json()
    assert answer["usage"]["completion_tokens"] == 3
    assert answer["choices"][0]["finish_reason"] == "length"


async def test_null_token_limits_mean_the_default_answer(quick: Client) -> None:
    body = {"model": "sim-model", "messages": HI, "max_tokens": None, "max_completion_tokens": None}
    reply = await quick.post("/v1/chat/completions", json=body)
    assert reply.status == 200
    answer = await reply.json()
    assert answer["usage"]["completion_tokens"] == SimConfig().output_tokens
    assert answer["choices"][0]["finish_reason"] == "stop"


async def test_the_router_reads_anthropic_errors_by_their_status(quick: Client) -> None:
    body = {"model": "x", "max_tokens": 5, "messages": HI}
    reply = await quick.post("/v1/messages", json=body)
    assert classify(reply.status, await reply.read())[:2] == (ErrorCode.MODEL_NOT_FOUND, 404)
    body = {"model": "sim-model", "max_tokens": 0, "messages": HI}
    reply = await quick.post("/v1/messages", json=body)
    assert classify(reply.status, await reply.read())[:2] == (ErrorCode.INVALID_PARAMETER, 400)


@pytest.mark.parametrize(
    ("path", "extra"),
    [("/v1/chat/completions", {"messages": HI}), ("/v1/completions", {"prompt": "hi"})],
)
async def test_n_gives_n_choices_and_usage_counts_them_all(
    quick: Client, path: str, extra: dict[str, object]
) -> None:
    body = {"model": "sim-model", "max_tokens": 4, "n": 3, **extra}
    answer = await (await quick.post(path, json=body)).json()
    assert [choice["index"] for choice in answer["choices"]] == [0, 1, 2]
    assert answer["usage"]["completion_tokens"] == 12
    reply = await quick.post(
        path, json={**body, "stream": True, "stream_options": {"include_usage": True}}
    )
    events = [
        orjson.loads(line[6:])
        for line in (await reply.read()).split(b"\n\n")
        if line.startswith(b"data: {")
    ]
    pieces = {index: 0 for index in range(3)}
    finished = set()
    for event in events:
        for choice in event["choices"]:
            text = choice.get("text") or (choice.get("delta") or {}).get("content")
            pieces[choice["index"]] += bool(text)
            if choice["finish_reason"]:
                finished.add(choice["index"])
    assert pieces == {0: 4, 1: 4, 2: 4} and finished == {0, 1, 2}
    assert events[-1]["usage"]["completion_tokens"] == 12


async def test_n_must_be_a_positive_integer(quick: Client) -> None:
    body = {"model": "sim-model", "messages": HI, "n": 0}
    assert (await quick.post("/v1/chat/completions", json=body)).status == 400


async def test_a_limit_the_router_set_is_a_ceiling_not_a_length(quick: Client) -> None:
    body = {"model": "sim-model", "messages": HI, "max_tokens": 1000}
    natural = SimConfig().output_tokens
    router_set = {"X-Hivenet-Output-Bound": "default"}
    answer = await (await quick.post("/v1/chat/completions", json=body, headers=router_set)).json()
    assert answer["usage"]["completion_tokens"] == natural
    assert answer["choices"][0]["finish_reason"] == "stop"
    cut = {**body, "max_tokens": 5}
    answer = await (await quick.post("/v1/chat/completions", json=cut, headers=router_set)).json()
    assert answer["usage"]["completion_tokens"] == 5
    assert answer["choices"][0]["finish_reason"] == "length"
    asked = await (await quick.post("/v1/chat/completions", json=body)).json()
    assert asked["usage"]["completion_tokens"] == 1000  # the client's own limit: in full
