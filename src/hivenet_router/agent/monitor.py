"""What the agent watches on its own host: backend health, engine metrics, hardware.

An idle agent should cost next to nothing. Metrics are read with the agent's own lean HTTP
client and only the families the router uses are parsed; while nothing is in flight on this
agent and the engine last reported nothing running or waiting, the metrics page is read ten
times less often (the figures cannot have moved much without work).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from urllib.parse import urlsplit

from hivenet_router.agent.engines import EngineAdapter
from hivenet_router.agent.hardware import HardwareSampler
from hivenet_router.domain.agent import EngineHistograms, EngineSnapshot, HardwareSnapshot
from hivenet_router.http1.client import EngineClient, EngineError

log = logging.getLogger("hivenet.agent")

FAILURES_BEFORE_UNHEALTHY = 3
PROBE_TIMEOUT = 5.0
PAGE_LIMIT = 8 * 1024 * 1024
IDLE_SLOWDOWN = 10  # while idle, metrics are read every this many intervals (or on work)
IDLE_HARDWARE_SLOWDOWN = 5  # and hardware sampled every this many


class Pulse:
    """Wakes every session's heartbeat at once (an Event cleared by one waiter would be
    missed by the others)."""

    def __init__(self) -> None:
        self.version = 0
        self._event = asyncio.Event()

    def notify(self) -> None:
        self.version += 1
        self._event.set()
        self._event = asyncio.Event()

    async def wait(self, seen: int, timeout: float) -> bool:
        """Until a notification after `seen` (True) or `timeout` (False)."""
        if self.version != seen:
            return True
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._event.wait()
                return True
        return False


def _split(url: str) -> tuple[str, str]:
    """A URL's origin and its path (with the query); the root when it names no path, as
    `http://engine:8000/` does once its slash is trimmed."""
    parts = urlsplit(url)
    path = parts.path or "/"
    return f"{parts.scheme}://{parts.netloc}", f"{path}?{parts.query}" if parts.query else path


class BackendMonitor:
    """Backend health (three failures in a row to go unhealthy, one success to recover),
    the latest engine snapshot and the latest hardware snapshot."""

    def __init__(
        self,
        engine: EngineClient,
        adapter: EngineAdapter,
        health_url: str = "",
        busy: Callable[[], bool] = lambda: False,
        auth: Sequence[tuple[str, str]] = (),
    ) -> None:
        self._engine = engine
        self._adapter = adapter
        # `auth` is the engine's credential (Authorization: Bearer), sent with every probe,
        # scrape and model listing, and never logged.
        self._headers = [("accept", "*/*"), *auth]
        self._health_client, self._health_path = engine, adapter.health_path()
        self._health_headers = self._headers
        if health_url:
            origin, self._health_path = _split(health_url)
            self._health_client = EngineClient(origin, max_idle=1)
            if not _same_server(self._health_client, engine):
                # A credential for the backend is not handed to another server.
                self._health_headers = [("accept", "*/*")]
        self._metrics_path = adapter.metrics_path()
        self._busy = busy
        self.healthy = True
        self.probe_failure = ""  # why the last health probe failed, in words
        # Called when the backend turns unhealthy: an engine that went down has most often
        # lost its cache (the agent's picture of it is emptied, agent/process.py).
        self.on_down: Callable[[], None] = lambda: None
        self._failures = 0
        self._scrape_failing = False
        self.engine: EngineSnapshot | None = None
        self._metrics_text = ""  # the last good metrics page, read again for heartbeats
        self.hardware: HardwareSnapshot | None = None
        self.changed = asyncio.Event()
        self.sampled = Pulse()  # a new engine or hardware snapshot: the routing signals' cue
        self._woken = Pulse()  # the agent took work: idle sampling catches up at once

    @property
    def health_target(self) -> str:
        origin = self._health_client.origin
        return f"{origin.host_header}{origin.prefix}{self._health_path}"

    async def _get(
        self, client: EngineClient, path: str, headers: list[tuple[str, str]]
    ) -> tuple[int, bytes]:
        async with asyncio.timeout(PROBE_TIMEOUT):
            answer = await client.request("GET", path, headers)
            try:
                return answer.status, await answer.read(PAGE_LIMIT)
            finally:
                answer.release()

    async def probe(self) -> bool:
        try:
            status, _ = await self._get(
                self._health_client, self._health_path, self._health_headers
            )
        except TimeoutError:
            self.probe_failure = f"no answer within {PROBE_TIMEOUT:g} s"
            return False
        except EngineError as exc:
            self.probe_failure = str(exc) or type(exc).__name__
            return False
        if status >= 400:
            hint = " (check --backend-api-key-file)" if status in (401, 403) else ""
            self.probe_failure = f"HTTP {status}{hint}"
            return False
        return True

    async def wait_ready(self, interval: float, deadline: float) -> None:
        """Poll until the backend answers its health check. `deadline` 0 waits forever."""
        loop = asyncio.get_running_loop()
        give_up = loop.time() + deadline if deadline else None
        said = ""
        while not await self.probe():
            if self.probe_failure != said:  # why, each time it changes
                said = self.probe_failure
                log.info("waiting for the backend at %s: %s", self.health_target, said)
            if give_up is not None and loop.time() > give_up:
                raise TimeoutError(f"backend at {self.health_target} not ready in time")
            await asyncio.sleep(interval)
        log.info("backend at %s is ready", self.health_target)

    async def discover_model(self, interval: float) -> str:
        """The first model the engine lists (at the adapter's models path), once it lists
        one."""
        path = self._adapter.models_path()
        while True:
            try:
                status, raw = await self._get(self._engine, path, self._headers)
                models = self._adapter.parse_models(raw) if status == 200 else []
                if models:
                    if len(models) > 1:
                        log.warning(
                            "backend serves %d models; registering %s (use --model to choose)",
                            len(models),
                            models[0],
                        )
                    return models[0]
                if status != 200:
                    log.debug("model discovery: HTTP %d from %s", status, path)
            except (EngineError, TimeoutError, ValueError) as exc:
                log.debug("model discovery failed: %s", exc)
            log.info(
                "no model discovered at %s%s yet; retrying", self._engine.origin.host_header, path
            )
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
                        "backend failed %d health checks in a row: unhealthy (%s)",
                        self._failures,
                        self.probe_failure,
                    )
                    self.healthy = False
                    self.changed.set()
                    self.on_down()
            await asyncio.sleep(interval)

    def _idle(self) -> bool:
        snapshot = self.engine
        return (
            not self._busy()
            and snapshot is not None
            and not snapshot.running_requests
            and not snapshot.waiting_requests
        )

    def wake(self) -> None:
        """The agent took a request while idle: sample at the busy pace again."""
        self._woken.notify()

    async def _pause(self, interval: float, slowdown: int) -> None:
        """Until the next sample: `interval` while busy; while idle, `slowdown` intervals,
        cut short when the agent takes work to one interval from then (the engine has the
        request by then, and a CPU reading spans a whole interval). An idle agent thus
        wakes only for the samples it takes."""
        if not self._idle():
            await asyncio.sleep(interval)
        elif await self._woken.wait(self._woken.version, interval * slowdown):
            await asyncio.sleep(interval)  # woken by a request: one interval from it

    async def sample_engine_forever(self, interval: float) -> None:
        path = self._metrics_path
        if path is None:
            return
        while True:
            await self._scrape(path)
            await self._pause(interval, IDLE_SLOWDOWN)

    async def _scrape(self, path: str) -> None:
        try:
            status, raw = await self._get(self._engine, path, self._headers)
            if status != 200:
                raise EngineError(f"HTTP {status}")
            text = raw.decode("utf-8", "replace")
            self.engine = self._adapter.parse_metrics(text)
            self._metrics_text = text
            self.sampled.notify()
            if self._scrape_failing:
                log.info("engine metrics scrape recovered")
                self._scrape_failing = False
        except (EngineError, TimeoutError, ValueError) as exc:
            if not self._scrape_failing:
                log.warning(
                    "engine metrics scrape started failing (%s); routing signals "
                    "carry the last good snapshot",
                    exc,
                )
                self._scrape_failing = True

    def histograms(self) -> EngineHistograms | None:
        """The engine's histograms and finish reasons from the last page scraped (read
        only when a heartbeat goes out, not at every scrape)."""
        if not self._metrics_text:
            return None
        return self._adapter.parse_histograms(self._metrics_text)

    async def sample_hardware_forever(self, sampler: HardwareSampler, interval: float) -> None:
        while True:
            # NVML calls and psutil's reads of /proc block: keep them off the event loop.
            self.hardware = await asyncio.to_thread(sampler.sample)
            self.sampled.notify()
            await self._pause(interval, IDLE_HARDWARE_SLOWDOWN)

    async def close(self) -> None:
        if self._health_client is not self._engine:
            await self._health_client.close()


def _same_server(a: EngineClient, b: EngineClient) -> bool:
    return (a.origin.scheme, a.origin.host, a.origin.port) == (
        b.origin.scheme,
        b.origin.host,
        b.origin.port,
    )


def signal_key(engine: EngineSnapshot | None, hardware: HardwareSnapshot | None) -> object:
    """What a routing signal tells the router, at the precision routing reads it with. A
    signal whose key has not changed is not sent again (heartbeats still carry the latest
    snapshots): an idle agent then sends next to nothing."""
    if hardware is None:
        return engine, None
    gpus = tuple(
        (
            gpu.uuid,
            _step(gpu.util_percent, 5),
            _step(gpu.temperature_c, 2),
            _step(_percent(gpu.vram_used_bytes, gpu.vram_total_bytes), 1),
        )
        for gpu in hardware.gpus
    )
    return (
        engine,
        _step(hardware.cpu_usage_percent, 5),
        _step(hardware.memory_used_percent, 2),
        gpus,
    )


def _step(value: float | None, step: float) -> int | None:
    return None if value is None else round(value / step)


def _percent(used: int | None, total: int | None) -> float | None:
    return None if used is None or not total else 100.0 * used / total
