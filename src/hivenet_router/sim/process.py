"""Run the simulator, in one process or several sharing the port."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing
import signal

from hivenet_router.config.sim import SimConfig
from hivenet_router.listeners import start_site
from hivenet_router.runtime import run, setup_logging
from hivenet_router.sim.server import Simulator

log = logging.getLogger("hivenet.sim")


def _serve_one(config: SimConfig, reuse_port: bool) -> int:
    async def main(stop: asyncio.Event) -> int:
        sim = Simulator(config)
        try:
            if sim.kv_events is not None:
                where = f"--kv-events-port {config.kv_events_port}"
                await sim.kv_events.start(config.host, config.kv_events_port)
            where = f"--port {config.port}"
            runner = await start_site(sim.app(), config.host, config.port, reuse_port=reuse_port)
        except OSError as exc:  # the port is taken, or the address is not this host's
            log.error("cannot listen on %s (%s): %s", config.host, where, exc.strerror or exc)
            if sim.kv_events is not None:
                await sim.kv_events.close()
            sim.close()
            return 1
        log.info(
            "hivenet-sim serving %s on http://%s:%d (zero latency: %s)",
            config.model,
            config.host,
            config.port,
            config.zero_latency,
        )
        try:
            await stop.wait()
        finally:
            await runner.cleanup()
            if sim.kv_events is not None:
                await sim.kv_events.close()
            sim.close()
        return 0

    return run(main)


def _worker(config: SimConfig, index: int) -> None:
    setup_logging("info", "text")
    # Each worker is its own engine; give each a distinct seed so faults do not move in step.
    _serve_one(dataclasses.replace(config, seed=config.seed + index), reuse_port=True)


def serve(config: SimConfig) -> int:
    if config.workers == 1:
        return _serve_one(config, reuse_port=False)
    context = multiprocessing.get_context("spawn")
    workers = [
        context.Process(target=_worker, args=(config, index), daemon=True)
        for index in range(config.workers)
    ]
    for worker in workers:
        worker.start()

    def stop(signum: int, frame: object) -> None:
        for worker in workers:
            if worker.is_alive():
                worker.terminate()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    for worker in workers:
        worker.join()
    return max((worker.exitcode or 0) for worker in workers)
