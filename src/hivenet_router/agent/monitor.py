"""What the agent watches on its own host: backend health, engine metrics, hardware."""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from hivenet_router.agent.engines import EngineAdapter
from hivenet_router.agent.hardware import HardwareSampler
from hivenet_router.domain.agent import EngineSnapshot, HardwareSnapshot

log = logging.getLogger("hivenet.agent")

FAILURES_BEFORE_UNHEALTHY = 3
PROBE_TIMEOUT = aiohttp.ClientTimeout(total=5)


class BackendMonitor:
    """Backend health (three failures in a row to go unhealthy, one success to recover),
    the latest engine snapshot and the latest hardware snapshot."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        adapter: EngineAdapter,
        backend_url: str,
        health_url: str,
    ) -> None:
        self._session = session
        self._adapter = adapter
        self._health_url = health_url or backend_url + adapter.health_path()
        metrics = adapter.metrics_path()
        self._metrics_url = backend_url + metrics if metrics else None
        self._backend_url = backend_url
        self.healthy = True
        self._failures = 0
        self._scrape_failing = False
        self.engine: EngineSnapshot | None = None
        self.hardware: HardwareSnapshot | None = None
        self.changed = asyncio.Event()

    async def probe(self) -> bool:
        try:
            async with self._session.get(self._health_url, timeout=PROBE_TIMEOUT) as resp:
                await resp.read()
                return resp.status < 400
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def wait_ready(self, interval: float, deadline: float) -> None:
        """Poll until the backend answers its health check. `deadline` 0 waits forever."""
        loop = asyncio.get_running_loop()
        give_up = loop.time() + deadline if deadline else None
        logged = False
        while not await self.probe():
            if not logged:
                log.info("waiting for the backend at %s", self._health_url)
                logged = True
            if give_up is not None and loop.time() > give_up:
                raise TimeoutError(f"backend at {self._health_url} not ready in time")
            await asyncio.sleep(interval)
        log.info("backend at %s is ready", self._health_url)

    async def discover_model(self, interval: float) -> str:
        url = self._backend_url + "/v1/models"
        while True:
            try:
                async with self._session.get(url, timeout=PROBE_TIMEOUT) as resp:
                    if resp.status == 200:
                        body = await resp.json(content_type=None)
                        data = body.get("data") if isinstance(body, dict) else None
                        if isinstance(data, list) and data and isinstance(data[0], dict):
                            model = data[0].get("id")
                            if isinstance(model, str) and model:
                                if len(data) > 1:
                                    log.warning(
                                        "backend serves %d models; registering %s "
                                        "(use --model to choose)",
                                        len(data),
                                        model,
                                    )
                                return model
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                log.debug("model discovery failed: %s", exc)
            log.info("no model discovered at %s yet; retrying", url)
            await asyncio.sleep(interval)

    async def check_health_forever(self, interval: float) -> None:
        while True:
            ok = await self.probe()
            if ok:
                if not self.healthy:
                    log.info("backend healthy again")
                    self.healthy = True
                    self.changed.set()
                self._failures = 0
            else:
                self._failures += 1
                if self.healthy and self._failures >= FAILURES_BEFORE_UNHEALTHY:
                    log.warning(
                        "backend failed %d health checks in a row: unhealthy", self._failures
                    )
                    self.healthy = False
                    self.changed.set()
            await asyncio.sleep(interval)

    async def sample_engine_forever(self, interval: float) -> None:
        if self._metrics_url is None:
            return
        while True:
            try:
                async with self._session.get(self._metrics_url, timeout=PROBE_TIMEOUT) as resp:
                    if resp.status != 200:
                        raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status)
                    text = await resp.text()
                self.engine = self._adapter.parse_metrics(text)
                if self._scrape_failing:
                    log.info("engine metrics scrape recovered")
                    self._scrape_failing = False
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                if not self._scrape_failing:
                    log.warning(
                        "engine metrics scrape started failing (%s); routing signals "
                        "carry the last good snapshot",
                        exc,
                    )
                    self._scrape_failing = True
            await asyncio.sleep(interval)

    async def sample_hardware_forever(self, sampler: HardwareSampler, interval: float) -> None:
        while True:
            # NVML calls block; keep them off the event loop.
            self.hardware = await asyncio.to_thread(sampler.sample)
            await asyncio.sleep(interval)
