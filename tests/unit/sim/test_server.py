"""The simulator's fault admin routes and /metrics, served in process."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from hivenet_router.config.options import ConfigError, load
from hivenet_router.config.sim import SimConfig
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
