"""What one sync round costs at 10, 1,000 and 10,000 active keys, in this process.

Two `Site` objects per size (router IDs `a` and `b`, a site of their own in a dedicated
valkey-server) stand for two routers. Before each measured round both charge the same K
keys once in the request-rate counter (`rates`) and once in the daily totals (`daily`),
and `b` runs its round, so `a` has K foreign usages to read from the stream and K daily
hashes with `b`'s field in them. Then `a`'s round is timed: wall time, this process's CPU
(`time.process_time`), and the store's command count, bytes in and out and CPU from
`INFO` deltas (what the two INFO calls themselves add is measured with nothing between
them and taken off). The sizes are interleaved round after round.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass

from bench.site_fleet import Store
from hivenet_router.clock import SystemClock
from hivenet_router.config.router import RouterConfig
from hivenet_router.domain.site import SiteDirectory, SiteRouter
from hivenet_router.router.wiring import local_ports
from hivenet_router.state.ports import Ports
from hivenet_router.sync.site import Site

RATE_LIMIT = 1_000_000  # per minute: never refuses in a run
DAILY_LIMIT = 10**12


@dataclass
class RoundCost:
    keys: int
    rounds: int
    wall_ms: float
    cpu_ms: float
    commands: float
    bytes_in: float
    bytes_out: float
    store_cpu_ms: float

    @property
    def cpu_us_per_key(self) -> float:
        return 1000 * self.cpu_ms / self.keys

    @property
    def bytes_per_key(self) -> float:
        return (self.bytes_in + self.bytes_out) / self.keys


def make_site(addr: str, site: str, router_id: str, **options: object) -> Site:
    """A `Site` of `site` against the store at `addr` (or as `options` say)."""
    options.setdefault("sync_addr", addr)
    config = RouterConfig(
        sync_store="valkey",
        sync_site=site,
        router_id=router_id,
        **options,  # type: ignore[arg-type]
    )
    config.validate()
    return Site(config, SystemClock(), SiteDirectory(SiteRouter(router_id, "peer", "")))


async def charge(site: Site, keys: list[str]) -> None:
    for key in keys:
        await site.rates.charge(key, 1, RATE_LIMIT)
        await site.daily.charge(key, 10, DAILY_LIMIT)


def overhead(store: Store, tries: int = 5) -> dict[str, float]:
    """What a pair of `counters()` calls adds by itself (the median of `tries` pairs)."""
    samples: dict[str, list[float]] = {}
    for _ in range(tries):
        before = store.counters()
        after = store.counters()
        for name in before:
            samples.setdefault(name, []).append(after[name] - before[name])
    return {name: statistics.median(values) for name, values in samples.items()}


async def measure(store: Store, sizes: list[int], rounds: int, log: bool = True) -> list[RoundCost]:
    """`rounds` measured rounds per size, the sizes interleaved; medians per size."""
    pairs: dict[int, tuple[Site, Site, list[str]]] = {}
    try:
        for size in sizes:
            a = make_site(store.addr, f"rounds-{size}", "a")
            b = make_site(store.addr, f"rounds-{size}", "b")
            pairs[size] = (a, b, [f"tenant-{n:05d}" for n in range(size)])
            for site in (a, b, a, b):  # both live, both synced
                await site.round()
        for a, b, keys in pairs.values():  # first daily reads, not measured
            await charge(a, keys)
            await charge(b, keys)
            await b.round()
            await a.round()
        base = overhead(store)
        samples: dict[int, list[RoundCost]] = {size: [] for size in sizes}
        for index in range(rounds):
            order = sizes if index % 2 == 0 else sizes[::-1]
            for size in order:
                a, b, keys = pairs[size]
                await charge(a, keys)
                await charge(b, keys)
                await b.round()
                samples[size].append(await timed_round(store, a, size, base))
            if log:
                print(
                    f"  round {index + 1}/{rounds}: "
                    + ", ".join(f"{s} keys {samples[s][-1].cpu_ms:.2f} ms CPU" for s in sizes),
                    flush=True,
                )
    finally:
        for a, b, _ in pairs.values():
            for site in (a, b):
                site.credits.cancel()
                await site.client.aclose()
    return [median_of(size, group) for size, group in samples.items()]


async def timed_round(store: Store, site: Site, size: int, base: dict[str, float]) -> RoundCost:
    before = store.counters()
    wall, cpu = time.perf_counter(), time.process_time()
    await site.round()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    after = store.counters()
    delta = {name: after[name] - before[name] - base[name] for name in before}
    if not site.synced:
        raise SystemExit(f"the measured round at {size} keys failed: {site.health.errors}")
    return RoundCost(
        size,
        1,
        1000 * wall,
        1000 * cpu,
        delta["commands"],
        delta["bytes_in"],
        delta["bytes_out"],
        1000 * delta["cpu_s"],
    )


def median_of(size: int, group: list[RoundCost]) -> RoundCost:
    return RoundCost(
        size,
        len(group),
        statistics.median(r.wall_ms for r in group),
        statistics.median(r.cpu_ms for r in group),
        statistics.median(r.commands for r in group),
        statistics.median(r.bytes_in for r in group),
        statistics.median(r.bytes_out for r in group),
        statistics.median(r.store_cpu_ms for r in group),
    )


async def _requests(ports: Ports, n: int) -> float:
    """CPU us per request of the state calls one admitted request makes (request rate,
    occupancy reserve and release, daily charge and settle), `n` times over."""
    started = time.process_time()
    for _ in range(n):
        await ports.rates.charge("bench", 1, RATE_LIMIT)
        lease = await ports.occupancy.reserve("bench-model", 140, 180_000, 0.25, 0)
        await ports.daily.charge("bench", 140, DAILY_LIMIT)
        await ports.daily.settle("bench", 140, 135)
        if lease is not None:
            lease.release()
    return 1e6 * (time.process_time() - started) / n


async def port_cost(store: Store, n: int = 20_000, tries: int = 5) -> dict[str, float]:
    """The request path's state calls in memory and with the site's ports, interleaved
    `tries` times; medians."""
    config = RouterConfig()
    config.validate()
    memory, _ = local_ports(config, SystemClock())
    site = make_site(store.addr, "ports", "a")
    try:
        for _ in range(2):
            await site.round()
        shared = site.ports()
        await _requests(memory, 1000)
        await _requests(shared, 1000)  # the first daily read and credit grant
        samples: dict[str, list[float]] = {"memory": [], "site": []}
        for _ in range(tries):
            samples["memory"].append(await _requests(memory, n))
            samples["site"].append(await _requests(shared, n))
    finally:
        site.credits.cancel()
        await site.client.aclose()
    return {name: round(statistics.median(values), 2) for name, values in samples.items()}


def run(store: Store, sizes: list[int], rounds: int) -> tuple[list[RoundCost], dict[str, float]]:
    costs = asyncio.run(measure(store, sizes, rounds))
    return costs, asyncio.run(port_cost(store))
