"""What an agent sends the router about its engine and hardware, and when."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

import pytest
from aiohttp import web

from hivenet_router.agent import monitor as monitor_module
from hivenet_router.agent.engines import adapter_for
from hivenet_router.agent.monitor import BackendMonitor, signal_key
from hivenet_router.config.values import optional_http_url
from hivenet_router.domain.agent import EngineSnapshot, GpuSnapshot, HardwareSnapshot
from hivenet_router.http1.client import EngineClient
from tests.unit.agent.standin import engine


def hardware(cpu: float, util: float, used: int) -> HardwareSnapshot:
    gpu = GpuSnapshot("GPU-1", util_percent=util, vram_used_bytes=used, vram_total_bytes=1000)
    return HardwareSnapshot(cpu_usage_percent=cpu, memory_used_percent=40.0, gpus=[gpu])


def test_signals_are_sent_again_only_when_routing_would_notice() -> None:
    idle = EngineSnapshot(running_requests=0, kv_cache_utilization=0.0)
    base = signal_key(idle, hardware(3.0, 0.0, 100))
    assert signal_key(idle, hardware(4.0, 1.0, 104)) == base  # jitter of an idle machine
    assert signal_key(idle, hardware(30.0, 0.0, 100)) != base  # CPU load arrived
    assert signal_key(idle, hardware(3.0, 0.0, 200)) != base  # VRAM filled
    busy = EngineSnapshot(running_requests=1, kv_cache_utilization=0.0)
    assert signal_key(busy, hardware(3.0, 0.0, 100)) != base  # any engine change
    assert signal_key(idle, None) != base


@pytest.fixture
async def metrics_engine() -> AsyncIterator[tuple[str, list[float]]]:
    """An idle vLLM-shaped metrics page; the times it was read."""
    reads: list[float] = []
    page = "vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"

    async def metrics(request: web.Request) -> web.Response:
        reads.append(asyncio.get_running_loop().time())
        return web.Response(text=page)

    async with engine("GET", "/metrics", metrics) as url:
        yield url, reads


async def _until(check: Callable[[], bool], seconds: float = 5.0) -> None:
    async with asyncio.timeout(seconds):
        while not check():
            await asyncio.sleep(0.005)


async def test_an_idle_agent_reads_metrics_slowly_and_soon_when_work_arrives(
    metrics_engine: tuple[str, list[float]], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, reads = metrics_engine
    client = EngineClient(url)
    monitor = BackendMonitor(client, adapter_for("vllm"), busy=lambda: False)
    interval = 0.05
    monkeypatch.setattr(monitor_module, "IDLE_SLOWDOWN", 100)  # idle: 5 s between reads
    task = asyncio.create_task(monitor.sample_engine_forever(interval))
    try:
        await _until(lambda: len(reads) == 1 and monitor.engine is not None)
        assert monitor.sampled.version == 1  # each snapshot is announced
        await asyncio.sleep(interval * 4)
        assert len(reads) == 1
        woken = asyncio.get_running_loop().time()
        monitor.wake()  # a request arrived: the next read one interval from it
        await _until(lambda: len(reads) == 2, seconds=1.0)
        assert interval * 0.9 <= reads[1] - woken < interval * 10
        # The engine saw the read; the snapshot is announced once its answer is parsed,
        # a moment later on a loaded machine.
        await _until(lambda: monitor.sampled.version == 2)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await client.close()


class CountingSampler:
    """Stands in for HardwareSampler: counts its samples."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def sample(self) -> HardwareSnapshot:
        self.times.append(time.monotonic())
        return HardwareSnapshot(cpu_usage_percent=1.0, memory_used_percent=1.0)


async def test_an_idle_agent_samples_hardware_slowly_and_one_interval_after_work(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monitor = BackendMonitor(EngineClient("http://127.0.0.1:9"), adapter_for("vllm"))
    monitor.engine = EngineSnapshot(running_requests=0, waiting_requests=0)  # idle
    monkeypatch.setattr(monitor_module, "IDLE_HARDWARE_SLOWDOWN", 100)
    sampler = CountingSampler()
    interval = 0.05
    task = asyncio.create_task(
        monitor.sample_hardware_forever(sampler, interval)  # type: ignore[arg-type]
    )
    try:
        await _until(lambda: len(sampler.times) == 1)
        await asyncio.sleep(interval * 4)
        assert len(sampler.times) == 1 and monitor.sampled.version == 1
        woken = time.monotonic()
        monitor.wake()
        await _until(lambda: len(sampler.times) == 2, seconds=1.0)
        # Not at once: a CPU reading over a few milliseconds would be noise.
        assert sampler.times[1] - woken >= interval * 0.9
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@pytest.mark.parametrize("suffix", ["/", "", "/?full=1"])
async def test_a_health_url_at_the_root_probes_the_root(suffix: str) -> None:
    """`--health-url http://engine:8000/` is kept without its slash: still the root."""
    paths: list[str] = []

    async def root(request: web.Request) -> web.Response:
        paths.append(request.path_qs)
        return web.Response(text="ok")

    async with engine("GET", "/", root) as origin:
        client = EngineClient(origin)
        monitor = BackendMonitor(
            client, adapter_for("custom"), health_url=optional_http_url(origin + suffix)
        )
        try:
            assert await monitor.probe()
            assert paths == ["/?full=1" if "?" in suffix else "/"]
        finally:
            await monitor.close()
            await client.close()


async def test_a_backend_that_goes_down_empties_what_the_agent_says_it_caches() -> None:
    """An engine that went down has most often lost its cache; once it is unhealthy the
    agent's picture of that cache is emptied (on_down), once, not at every failed probe."""
    answers = [True, False, False, False, False, True]
    downs: list[int] = []

    async def probe() -> bool:
        return answers.pop(0) if answers else True

    client = EngineClient("http://127.0.0.1:9")
    monitor = BackendMonitor(client, adapter_for("custom"))
    monitor.probe = probe  # type: ignore[method-assign]
    monitor.on_down = lambda: downs.append(len(answers))
    task = asyncio.create_task(monitor.check_health_forever(0.0))
    try:
        async with asyncio.timeout(5):
            while answers:
                await asyncio.sleep(0)
            await asyncio.sleep(0)
        assert monitor.healthy
        assert downs == [2]  # after the third failure in a row, once
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await monitor.close()
        await client.close()


@pytest.mark.parametrize(
    ("status", "said"), [(401, "HTTP 401 (check --backend-api-key-file)"), (404, "HTTP 404")]
)
async def test_a_failed_probe_says_why(status: int, said: str) -> None:
    """An engine that refused the agent's key left it "waiting for the backend" forever
    without a word on why (found by a new user)."""

    async def refuse(request: web.Request) -> web.Response:
        return web.Response(status=status)

    async with engine("GET", "/health", refuse) as origin:
        client = EngineClient(origin)
        monitor = BackendMonitor(client, adapter_for("vllm"))
        try:
            assert not await monitor.probe()
            assert monitor.probe_failure == said
            assert monitor.health_target.endswith("/health")
        finally:
            await monitor.close()
            await client.close()
