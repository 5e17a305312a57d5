"""What a router's sync round costs at internet scale: 10 to 100,000 active keys.

    make bench-site-scale                          # about 4 minutes on 2 cores
    python -m bench.site_scale --keys 10,1000 --rounds 3 --no-docs

Two `Site` objects (routers `a` and `b` of one site, in this process) against one store.
Every key is charged once on both routers first (each router follows it: a key used in the
last five minutes), then rounds run in two shapes:

- `1%`: before each round both routers charge 1% of the keys (at least one; a window that
  moves round by round), the shape of a public gateway with 100,000 keys used in the last
  five minutes and 1,000 in the last second; the rounds before the measured ones bring the
  re-reads of what changed to their steady state;
- `all`: every key charged before every round, the worst case (the earlier table).

`b` runs its round, then `a`'s is timed: wall time, this process's CPU
(`time.process_time`), and the store's commands, bytes and CPU from `INFO` deltas (summed
over the nodes of a cluster; what the `INFO` calls add is measured alone and taken off).
Then `a` idles: rounds with nothing charged. Medians.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tests.valkey_cluster import ValkeyCluster

from bench.common import Fleet, publish
from bench.site_fleet import Store
from bench.site_rounds import DAILY_LIMIT, RATE_LIMIT, make_site
from hivenet_router.sync.daily import REFRESH_ROUNDS
from hivenet_router.sync.site import Site

FIRST_READS_AT_ONCE = 200  # first daily reads in flight together while the keys are set up


Counters = Callable[[], dict[str, float]]  # the store's INFO counters, summed over its nodes


@dataclass
class Cost:
    store: str
    keys: int
    shape: str  # "1%", "all", "idle"
    changed: int  # keys charged on each router before each round
    rounds: int
    wall_ms: float
    cpu_ms: float
    commands: float
    bytes_in: float
    bytes_out: float
    store_cpu_ms: float


def changed_for(shape: str, keys: int) -> int:
    return {"all": keys, "1%": max(1, keys // 100), "idle": 0}[shape]


async def charge(site: Site, keys: list[str]) -> None:
    for key in keys:
        await site.rates.charge(key, 1, RATE_LIMIT)
        await site.daily.charge(key, 10, DAILY_LIMIT)


async def follow(site: Site, keys: list[str]) -> None:
    """Charge every key once, the first daily reads a few hundred at a time."""
    for start in range(0, len(keys), FIRST_READS_AT_ONCE):
        chunk = keys[start : start + FIRST_READS_AT_ONCE]
        await asyncio.gather(*(charge(site, [key]) for key in chunk))


def overhead(counters: Counters, tries: int = 5) -> dict[str, float]:
    samples: dict[str, list[float]] = {}
    for _ in range(tries):
        before = counters()
        after = counters()
        for name in before:
            samples.setdefault(name, []).append(after[name] - before[name])
    return {name: statistics.median(values) for name, values in samples.items()}


async def timed(counters: Counters, site: Site, base: dict[str, float]) -> list[float]:
    before = counters()
    wall, cpu = time.perf_counter(), time.process_time()
    await site.round()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    after = counters()
    if not site.synced:
        raise SystemExit(f"a measured round failed: {site.health.errors}")
    delta = {name: after[name] - before[name] - base[name] for name in before}
    return [
        1000 * wall,
        1000 * cpu,
        delta["commands"],
        delta["bytes_in"],
        delta["bytes_out"],
        1000 * delta["cpu_s"],
    ]


async def measure_size(
    counters: Counters, where: dict[str, object], size: int, shapes: list[str], rounds: int
) -> list[Cost]:
    """`where`: the store's options (sync_addr or sync_cluster) and its name (`store`)."""
    name = str(where["store"])
    options = {k: v for k, v in where.items() if k != "store"}
    site_name = f"scale-{name.split(maxsplit=1)[0]}-{size}-{time.monotonic_ns()}"
    a = make_site("", site_name, "a", **options)
    b = make_site("", site_name, "b", **options)
    keys = [f"tenant-{n:06d}" for n in range(size)]
    out: list[Cost] = []
    try:
        for site in (a, b, a, b):
            await site.round()
        await follow(a, keys)
        await follow(b, keys)
        base = overhead(counters)
        window = 0
        for shape in shapes:
            count = changed_for(shape, size)
            warm = 2 if shape == "all" else REFRESH_ROUNDS + 2
            samples: list[list[float]] = []
            for index in range(warm + rounds):
                chosen = [keys[(window + n) % size] for n in range(count)]
                window = (window + count) % size
                await charge(a, chosen)
                await charge(b, chosen)
                await b.round()
                if index < warm:
                    await a.round()
                else:
                    samples.append(await timed(counters, a, base))
            medians = [statistics.median(column) for column in zip(*samples, strict=True)]
            out.append(Cost(name, size, shape, count, rounds, *medians))
            print(f"  {name} {size:,} keys, {shape}: {out[-1].cpu_ms:.2f} ms CPU", flush=True)
    finally:
        for site in (a, b):
            site.credits.cancel()
            await site.client.aclose()
    return out


def render(costs: list[Cost], command: str) -> str:
    lines = [
        f"Measured {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC with `{command}`, "
        "in one process on this 2-core machine, shared with other work: router CPU within "
        "about 30%; rerun on a quiet machine for the exact figures.",
        "",
        "**One sync round of a router**, another router of the site charging the same keys; "
        "every key followed (charged on both routers in the last five minutes). `1%`: 1% of "
        "the keys charged on each router before each round; `all`: every key, the worst "
        "case; `idle`: nothing charged. Commands, bytes and Valkey CPU are the store's "
        "`INFO` counters: on the cluster summed over its six nodes, the replicas' "
        "replication included (commands include those a script runs, bytes from it the "
        "replication stream; the CPU counters move in 10 ms steps, so a small figure can "
        "come out below zero). Share of a core, and of one Valkey thread, at the default "
        "`--sync-interval` of 1 s.",
        "",
        "| store | active keys | charged per round | wall ms | router CPU ms | router core "
        "| store commands | bytes to the store | bytes from it | Valkey CPU ms | Valkey thread |",
        "| --- | --: | --: | --: | --: | --: | --: | --: | --: | --: | --: |",
    ]
    for c in costs:
        lines.append(
            f"| {c.store} | {c.keys:,} | {c.changed:,} ({c.shape}) | {c.wall_ms:,.1f} | "
            f"{c.cpu_ms:,.2f} | {c.cpu_ms / 10:.2f}% | {c.commands:,.0f} | {c.bytes_in:,.0f} | "
            f"{c.bytes_out:,.0f} | {c.store_cpu_ms:.2f} | {c.store_cpu_ms / 10:.2f}% |"
        )
    return "\n".join(lines)


def measure_store(
    kind: str, fleet: Fleet, tmp: Path, sizes: list[int], shapes: list[str], args: Any
) -> list[Cost]:
    """Every size on one store: a valkey-server (`primary`) or a cluster of 3 primaries
    and 3 replicas (`cluster`)."""
    out: list[Cost] = []

    def each(counters: Counters, where: dict[str, object]) -> None:
        for size in sizes:
            chosen = [s for s in shapes if s != "all" or size <= args.all_up_to]
            out.extend(asyncio.run(measure_size(counters, where, size, chosen, args.rounds)))

    if kind == "primary":
        primary = Store(fleet, "valkey-scale")
        try:
            each(primary.counters, {"store": "primary", "sync_addr": primary.addr})
        finally:
            primary.close()
            fleet.stop(["valkey-scale"])
    else:
        with ValkeyCluster(tmp / "cluster") as cluster:
            where: dict[str, object] = {"store": "cluster (3+3)", "sync_cluster": cluster.seeds}
            where["sync_addr"] = ""
            each(cluster.counters, where)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--keys", default="10,1000,10000,100000")
    parser.add_argument("--shapes", default="idle,1%,all")
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds per shape")
    parser.add_argument("--all-up-to", type=int, default=10_000, help="largest size for all")
    parser.add_argument("--stores", default="primary,cluster", help="primary, cluster or both")
    parser.add_argument("--no-docs", action="store_true")
    args = parser.parse_args()
    sizes = [int(k) for k in args.keys.split(",")]
    shapes = args.shapes.split(",")
    given = " ".join(sys.argv[1:])
    command = "make bench-site-scale" + (f' ARGS="{given}"' if given else "")
    tmp = Path(tempfile.mkdtemp(prefix="hivenet-bench-scale-"))
    fleet = Fleet(tmp)
    costs: list[Cost] = []
    try:
        for kind in args.stores.split(","):
            costs += measure_store(kind, fleet, tmp, sizes, shapes, args)
    finally:
        fleet.stop()
    publish("site-scale", [asdict(c) for c in costs], render(costs, command), not args.no_docs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
