"""The routing benchmark's scenarios: this router alone, fresh simulators for every run,
one target each, printed as met or not met.

- uniform: four identical simulators, random prompts (no shared prefix), 8 clients one
  request after another. Target: no engine serves more than 1/N + 10 points.
- failing: the main workload's fleet and sessions (96, in bursts 10 s apart), one
  simulator (fast-big) answering half its generations with HTTP 500. Targets: client
  error rate under 1%, and the failing agent's circuit breaker open after at most 20
  outcomes (`opened_after` in /admin/routing-table, polled four times a second, with the
  time to its first open).
- slowdown: four identical simulators, 16 clients; at t = 20 s one simulator becomes 3x
  slower (`POST /admin/faults {"slowdown": 3}`). Every simulator's served requests are
  read each second; target: the slowed one's share falls below 0.6 x its share before
  (seconds 3 to 20), and stays there to the end, within 10 s. The share is judged over
  3-second trailing windows (a single second holds only a handful of its requests, so
  one busy second would otherwise decide), which adds up to a second or two of lag; the
  single-second figure is kept beside it. Run for the strategy under test, least-loaded
  and, if the router takes it, scored latency-first.
- burst: two tenants (two static keys, owners tenant-a and tenant-b), two simulators of 4
  sequences behind agents of capacity 4, so requests wait in the router's per-model queue.
  B sends 6 requests/s throughout (Poisson, the same arrivals in every run); A sends
  6/s, or 60/s for 10 s in the burst runs. Together the usual rates load the fleet to
  about half its capacity, so requests already wait now and then; the burst is more than
  twice what the fleet can serve. Target: B's time to first token p99 over the burst
  window (from its start to 6 s after its end) at most 2x the same window's without the
  burst. Run a third time with one key for both (one tenant: plain FIFO).

About five and a half minutes in all on 2 cores; --quick (uniform 15 s, failing 36
sessions, slowdown 25 s with the change at 10 s, a burst of 8 s) about four.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import secrets
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.common import MODEL, Fleet
from bench.routing_fleet import (
    COMMON,
    ENGINES,
    HiveRunning,
    Outcome,
    Policy,
    PolicyRefused,
    RouterSetup,
    Turn,
    admin_get,
    auth_yaml,
    chat_body,
    client,
    closed_loop,
    drive,
    engine_counters,
    quantile,
    random_prompt,
    routing_table,
    served,
    set_faults,
    start_router,
    start_sims,
    stream_chat,
    workload,
)

CHAT = "/v1/chat/completions"
IDENTICAL = [
    *("--ttft-base", "10ms", "--itl", "8ms", "--prefill-per-token", "0.02ms"),
    *("--max-num-seqs", "8", "--kv-cache-tokens", "65536", "--max-model-len", "8192"),
]
# Two of these behind capacity-4 agents serve about 22 requests/s of 32 tokens.
SMALL = ["--ttft-base", "20ms", "--itl", "10ms", "--max-num-seqs", "4", "--max-model-len", "8192"]
FAILING_ENGINE = "fast-big"
SLOWDOWN = 3.0
SLOWDOWN_CLIENTS = 16
SMOOTHING = 3  # seconds in the trailing window the slowdown's reaction is judged on


@dataclass(frozen=True)
class Timing:
    uniform_s: float
    failing_sessions: int
    failing_gap: float  # seconds between the three bursts of sessions
    slowdown_s: int
    slowdown_change: int  # the second at which one simulator slows down
    burst_lead: float
    burst_s: float
    burst_tail: float


FULL = Timing(25, 96, 10, 36, 20, 4, 10, 6)
QUICK = Timing(15, 36, 6, 25, 10, 3, 6, 5)
USUAL_RATE = 6.0  # requests per second of each tenant
BURST_FACTOR = 10


@dataclass
class Context:
    tmp: Path
    quick: bool
    policy: Policy  # the strategy under test
    fallback: Policy | None
    scored_preset: str
    runs: int = 0

    @property
    def timing(self) -> Timing:
        return QUICK if self.quick else FULL

    def folder(self, name: str) -> Path:
        self.runs += 1
        path = self.tmp / f"scenario-{self.runs:02d}-{name.replace(' ', '-')}"
        path.mkdir(parents=True)
        return path

    def log(self, line: str) -> None:
        print(f"  {line}", file=sys.stderr, flush=True)


@dataclass
class Target:
    scenario: str
    what: str
    goal: str
    measured: str
    met: bool


@dataclass
class UniformResult:
    system: str
    seconds: float
    clients: int
    requests: int
    errors: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    share: dict[str, float]
    command: str


@dataclass
class FailingResult:
    system: str
    failing_engine: str
    requests: int
    errors: int
    client_error_rate: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    received: dict[str, float]  # requests each engine received, errors included
    share: dict[str, float]  # of the requests served
    breaker_reported: bool  # /admin/routing-table had a breaker section
    first_open_s: float | None  # after the load began
    opened_after: int | None  # at its first open
    opened_after_seen: list[int]
    opens: int  # the failing agent's breaker, transitions to open
    other_opens: dict[str, int]  # the healthy agents' breakers
    states: list[tuple[float, str]]  # the failing agent's breaker states as they changed
    polls: int
    command: str


@dataclass
class SlowdownRun:
    system: str
    slowed: str
    factor: float
    change_s: int
    requests: int
    errors: int
    share_before: float
    share_after: float  # over the last half of the time after the change
    threshold: float
    reaction_s: int | None  # seconds after the change; None: never stayed below
    reaction_raw_s: int | None  # the same, judged on single seconds (noisy)
    shares: list[float | None]  # the slowed engine's share, second by second
    smoothed: list[float]  # the same over SMOOTHING-second trailing windows
    totals: list[float]  # requests served per second by the fleet
    command: str


@dataclass
class BurstRun:
    label: str
    system: str
    keys: str
    a_rate: float  # during the burst window
    window: list[float]  # B is measured from the burst's start to burst_tail after its end
    burst_end: float
    b_requests: int  # sent in the window
    b_errors: int
    b_ttft_p50_ms: float
    b_ttft_p99_ms: float
    b_ttft_ms: list[float]  # in the window, for the plot
    a_requests: int
    a_errors: int
    a_ttft_p50_ms: float
    a_ttft_p99_ms: float
    queue_peak: int  # the model's fair queue in the router
    global_queue_peak: int  # the router's global queue (FIFO)
    b_timeline: list[tuple[float, float | None]]  # B in the window: sent at, TTFT
    seconds: float
    command: str


@dataclass
class Scenarios:
    uniform: UniformResult | None = None
    failing: FailingResult | None = None
    slowdown: list[SlowdownRun] = field(default_factory=list)
    burst: list[BurstRun] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def target(self, scenario: str, what: str, goal: str, measured: str, met: bool) -> None:
        self.targets.append(Target(scenario, what, goal, measured, met))
        verdict = "met" if met else "NOT MET"
        print(f"  target {scenario}: {what} {measured} (target {goal}): {verdict}", flush=True)


@contextmanager
def fleet_in(folder: Path) -> Iterator[Fleet]:
    fleet = Fleet(folder)
    try:
        yield fleet
    finally:
        fleet.stop()


def ran_as(running: HiveRunning, results: Scenarios, scenario: str) -> str:
    """The system's name: the strategy it ran, and what it was asked for if refused."""
    if not running.refused:
        return f"hivenet {running.strategy}"
    asked = running.asked
    note = f"{scenario}: this router refused `{asked}` ({running.refused}); "
    note += f"it ran {running.strategy} instead."
    if note not in results.notes:
        results.notes.append(note)
    return f"hivenet {running.strategy} (asked {asked})"


def _served_now(sims: dict[str, str]) -> dict[str, float]:
    return {name: engine_counters(url)["requests"] for name, url in sims.items()}


def _shares(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    done = {name: after[name] - before[name] for name in after}
    total = sum(done.values()) or 1.0
    return {name: n / total for name, n in done.items()}


# -- uniform ---------------------------------------------------------------------------------


def run_uniform(ctx: Context, results: Scenarios) -> None:
    seconds, clients = ctx.timing.uniform_s, 8
    folder = ctx.folder("uniform")
    with fleet_in(folder) as fleet:
        sims = start_sims(fleet, {f"engine-{n}": IDENTICAL for n in range(4)})
        running = start_router(fleet, sims, folder, RouterSetup(ctx.policy, ctx.fallback))
        system = ran_as(running, results, "uniform")
        ctx.log(f"{system}: {clients} clients for {seconds:.0f} s")
        before = _served_now(sims)
        outcome = asyncio.run(closed_loop(running.url + CHAT, clients, seconds, 120, 32, 5))
        share = _shares(before, _served_now(sims))
    results.uniform = UniformResult(
        system,
        seconds,
        clients,
        outcome.completed,
        outcome.errors,
        quantile(outcome.ttft_ms, 0.5),
        quantile(outcome.ttft_ms, 0.99),
        share,
        running.command,
    )
    top = max(share, key=lambda name: share[name])
    goal = 1 / len(share) + 0.10
    measured = f"{100 * share[top]:.1f}% ({top})"
    results.target(
        "uniform", "largest engine share", f"<= {100 * goal:.0f}%", measured, share[top] <= goal
    )


# -- failing ---------------------------------------------------------------------------------


@dataclass
class BreakerWatch:
    """What the routing table said of the agents' breakers, polled during the run."""

    engine: str  # the failing one (its agent's --machine)
    polls: int = 0
    reported: bool = False
    first_open_s: float | None = None
    opened_after: int | None = None
    opened_after_seen: list[int] = field(default_factory=list)
    opens: int = 0
    other_opens: dict[str, int] = field(default_factory=dict)
    states: list[tuple[float, str]] = field(default_factory=list)

    def note(self, agents: list[dict[str, Any]], at: float) -> None:
        self.polls += 1
        for agent in agents:
            breaker = agent.get("breaker")
            name = (agent.get("metadata") or {}).get("machine", "?")
            if not isinstance(breaker, dict):
                continue
            self.reported = True
            opens = int((breaker.get("transitions") or {}).get("open", 0))
            if name != self.engine:
                self.other_opens[name] = opens
                continue
            self.opens = opens
            state = str(breaker.get("state"))
            if not self.states or self.states[-1][1] != state:
                self.states.append((round(at, 2), state))
            after = breaker.get("opened_after")
            if isinstance(after, int) and (state == "open" or opens > 0):
                if self.first_open_s is None:
                    self.first_open_s, self.opened_after = round(at, 2), after
                if after not in self.opened_after_seen:
                    self.opened_after_seen.append(after)

    async def run(self, url: str, began: float, stop: asyncio.Event, seconds: float) -> None:
        """Four polls a second until `stop` is set (and for `seconds` at most)."""
        async with client(5) as http:
            for _ in range(int(seconds * 4)):
                try:
                    agents = await routing_table(http, url)
                except (aiohttp.ClientError, TimeoutError, ValueError):
                    agents = []
                self.note(agents, time.monotonic() - began)
                try:
                    await asyncio.wait_for(stop.wait(), 0.25)
                    return
                except TimeoutError:
                    pass


async def _failing_load(
    url: str, prompts: list[str], sessions: list[Any], watch: BreakerWatch
) -> Outcome:
    stop = asyncio.Event()
    began = time.monotonic()
    poller = asyncio.ensure_future(watch.run(url, began, stop, 600))
    try:
        outcome, _ = await drive(url + CHAT, prompts, sessions)
    finally:
        stop.set()
        await poller
    return outcome


def run_failing(ctx: Context, results: Scenarios) -> None:
    t = ctx.timing
    prompts, sessions = workload(t.failing_sessions, gap=t.failing_gap)
    folder = ctx.folder("failing")
    flags = {e: [*COMMON, *f] for e, f in ENGINES.items()}
    flags[FAILING_ENGINE] += ["--fault-error-rate", "0.5"]
    watch = BreakerWatch(FAILING_ENGINE)
    with fleet_in(folder) as fleet:
        sims = start_sims(fleet, flags)
        running = start_router(fleet, sims, folder, RouterSetup(ctx.policy, ctx.fallback))
        system = ran_as(running, results, "failing")
        ctx.log(f"{system}: {len(sessions)} sessions, {FAILING_ENGINE} failing half its answers")
        before = {name: engine_counters(url) for name, url in sims.items()}
        outcome = asyncio.run(_failing_load(running.url, prompts, sessions, watch))
        after = {name: engine_counters(url) for name, url in sims.items()}
    sent = outcome.completed + outcome.errors
    rate = outcome.errors / sent if sent else 1.0
    results.failing = FailingResult(
        system,
        FAILING_ENGINE,
        outcome.completed,
        outcome.errors,
        rate,
        quantile(outcome.ttft_ms, 0.5),
        quantile(outcome.ttft_ms, 0.99),
        {n: after[n]["received"] - before[n]["received"] for n in sims},
        _shares(
            {n: c["requests"] for n, c in before.items()},
            {n: c["requests"] for n, c in after.items()},
        ),
        watch.reported,
        watch.first_open_s,
        watch.opened_after,
        watch.opened_after_seen,
        watch.opens,
        watch.other_opens,
        watch.states,
        watch.polls,
        running.command,
    )
    results.target(
        "failing", "client error rate", "< 1%", f"{100 * rate:.2f}% of {sent}", rate < 0.01
    )
    if not watch.reported:
        measured = "no breaker in /admin/routing-table"
    elif watch.opened_after is None:
        measured = "never opened"
    else:
        measured = f"{watch.opened_after} (first open at {watch.first_open_s:.1f} s)"
    met = watch.opened_after is not None and watch.opened_after <= 20
    results.target("failing", "breaker opened_after", "<= 20", measured, met)


# -- slowdown --------------------------------------------------------------------------------


async def _served_all(http: aiohttp.ClientSession, sims: dict[str, str]) -> dict[str, float]:
    counts = await asyncio.gather(*(served(http, url) for url in sims.values()))
    return dict(zip(sims, counts, strict=True))


async def _slowdown_load(
    url: str, sims: dict[str, str], slowed: str, t: Timing
) -> tuple[Outcome, list[dict[str, float]]]:
    """SLOWDOWN_CLIENTS clients for the run; every simulator's served count each second;
    the slowdown right after the sample at `t.slowdown_change`."""
    async with client(10) as http:
        clients, seconds = SLOWDOWN_CLIENTS, t.slowdown_s
        load = asyncio.ensure_future(closed_loop(url + CHAT, clients, seconds, 120, 24, 9))
        began = time.monotonic()
        samples = [await _served_all(http, sims)]
        for second in range(1, t.slowdown_s + 1):
            await asyncio.sleep(max(0.0, began + second - time.monotonic()))
            samples.append(await _served_all(http, sims))
            if second == t.slowdown_change:
                await set_faults(http, sims[slowed], {"slowdown": SLOWDOWN})
        outcome = await load
    return outcome, samples


def reaction(shares: Sequence[float | None], change: int, threshold: float) -> int | None:
    """The first second after the change (1 = the second right after it) from which the
    share stays below `threshold` to the end of the run; None if it never does."""
    found = None
    for index in range(len(shares) - 1, change - 1, -1):
        share = shares[index]
        if share is None or math.isnan(share) or share >= threshold:
            break
        found = index + 1 - change
    return found


def _window_share(deltas: list[dict[str, float]], name: str, first: int, last: int) -> float:
    """The share of `name` over seconds first..last (1-based, inclusive)."""
    chosen = deltas[first - 1 : last]
    total = sum(sum(d.values()) for d in chosen)
    return sum(d[name] for d in chosen) / total if total else float("nan")


def slowdown_run(ctx: Context, results: Scenarios, policy: Policy, fallback: Policy | None) -> None:
    t = ctx.timing
    folder = ctx.folder(f"slowdown-{policy.label}")
    slowed = "engine-0"
    with fleet_in(folder) as fleet:
        sims = start_sims(fleet, {f"engine-{n}": IDENTICAL for n in range(4)})
        running = start_router(fleet, sims, folder, RouterSetup(policy, fallback))
        system = ran_as(running, results, "slowdown")
        ctx.log(
            f"{system}: {t.slowdown_s} s, {slowed} {SLOWDOWN:.0f}x slower at {t.slowdown_change} s"
        )
        outcome, samples = asyncio.run(_slowdown_load(running.url, sims, slowed, t))
    deltas = [{n: b[n] - a[n] for n in b} for a, b in itertools.pairwise(samples)]
    shares = [d[slowed] / sum(d.values()) if sum(d.values()) else None for d in deltas]
    before = _window_share(deltas, slowed, 3, t.slowdown_change)
    half = max(5, (t.slowdown_s - t.slowdown_change) // 2)
    after = _window_share(deltas, slowed, t.slowdown_s - half + 1, t.slowdown_s)
    threshold = 0.6 * before
    smoothed = [
        _window_share(deltas, slowed, max(1, k - SMOOTHING + 1), k)
        for k in range(1, len(deltas) + 1)
    ]
    seconds = reaction(smoothed, t.slowdown_change, threshold)
    run = SlowdownRun(
        system,
        slowed,
        SLOWDOWN,
        t.slowdown_change,
        outcome.completed,
        outcome.errors,
        before,
        after,
        threshold,
        seconds,
        reaction(shares, t.slowdown_change, threshold),
        [None if s is None else round(s, 4) for s in shares],
        [round(s, 4) for s in smoothed],
        [sum(d.values()) for d in deltas],
        running.command,
    )
    results.slowdown.append(run)
    measured = "never" if seconds is None else f"{seconds} s"
    measured += f" (share {100 * before:.0f}% -> {100 * after:.0f}%)"
    results.target(
        "slowdown",
        f"{system}: reaction",
        "<= 10 s",
        measured,
        seconds is not None and seconds <= 10,
    )


def run_slowdown(ctx: Context, results: Scenarios) -> None:
    asked = [ctx.policy, Policy("least-loaded")]
    for n, policy in enumerate(asked):
        if policy not in asked[:n]:
            slowdown_run(ctx, results, policy, ctx.fallback)
    scored = Policy("scored", ctx.scored_preset)
    if scored in asked:
        return
    try:
        slowdown_run(ctx, results, scored, None)
    except PolicyRefused as refused:
        results.notes.append(
            f"slowdown: this router refused `{scored.label}` ({refused}); skipped."
        )
        ctx.log(f"scored {ctx.scored_preset} refused by this router: skipped")


# -- burst -----------------------------------------------------------------------------------


def arrivals(segments: list[tuple[float, float, float]], seed: int) -> list[float]:
    """Poisson arrival times: `rate` per second from `start` to `end`, per segment."""
    rng = random.Random(seed)
    out: list[float] = []
    for start, end, rate in segments:
        at = start + rng.expovariate(rate)
        for _ in range(int((end - start) * rate * 3) + 10):
            if at >= end:
                break
            out.append(at)
            at += rng.expovariate(rate)
    return out


@dataclass(frozen=True)
class Planned:
    at: float
    tenant: str
    key: str
    prompt: str


@dataclass
class QueueWatch:
    """The router's queues as /admin/health shows them, twice a second: the peak of the
    model's fair queue (waiting for an agent slot) and of the global FIFO one."""

    model_peak: int = 0
    global_peak: int = 0

    async def run(self, url: str, stop: asyncio.Event, seconds: float) -> None:
        async with client(5) as http:
            for _ in range(int(seconds * 2)):
                try:
                    health = await admin_get(http, url, "/admin/health")
                except (aiohttp.ClientError, TimeoutError, ValueError):
                    health = {}
                load = (health.get("models") or {}).get(MODEL) or {}
                self.model_peak = max(self.model_peak, int(load.get("waiting_for_capacity", 0)))
                waiting = int((health.get("queue") or {}).get("waiting", 0))
                self.global_peak = max(self.global_peak, waiting)
                try:
                    await asyncio.wait_for(stop.wait(), 0.5)
                    return
                except TimeoutError:
                    pass


async def _burst_load(
    url: str, plan: list[Planned], watch: QueueWatch
) -> list[tuple[Planned, float, Turn]]:
    """Every request at its time, whatever came before (open loop)."""
    stop = asyncio.Event()
    watcher = asyncio.ensure_future(watch.run(url, stop, 600))
    async with client(90) as http:
        began = time.monotonic()

        async def one(item: Planned) -> tuple[Planned, float, Turn]:
            await asyncio.sleep(max(0.0, began + item.at - time.monotonic()))
            sent = time.monotonic() - began
            body = chat_body([{"role": "user", "content": item.prompt}], 32)
            return item, sent, await stream_chat(http, url + CHAT, body, item.key)

        try:
            return await asyncio.gather(*(one(item) for item in plan))
        finally:
            stop.set()
            await watcher


def _plan(t: Timing, burst: bool, keys: dict[str, str]) -> list[Planned]:
    total = t.burst_lead + t.burst_s + t.burst_tail
    start, end = t.burst_lead, t.burst_lead + t.burst_s
    usual = USUAL_RATE
    a_rate = BURST_FACTOR * usual if burst else usual
    b_times = arrivals([(0.0, total, usual)], seed=21)
    a_times = arrivals([(0.0, start, usual), (start, end, a_rate), (end, total, usual)], seed=22)
    rng = random.Random(23)
    plan = [Planned(at, "b", keys["b"], random_prompt(rng, 40)) for at in b_times]
    plan += [Planned(at, "a", keys["a"], random_prompt(rng, 40)) for at in a_times]
    return sorted(plan, key=lambda p: p.at)


def burst_run(ctx: Context, results: Scenarios, label: str, burst: bool, shared: bool) -> BurstRun:
    t = ctx.timing
    token = secrets.token_hex(8)
    keys = {"a": f"sk-bench-a-{token}", "b": f"sk-bench-b-{token}"}
    owners = {keys["a"]: "tenant-a", keys["b"]: "tenant-b"}
    if shared:
        keys, owners = {"a": keys["a"], "b": keys["a"]}, {keys["a"]: "tenant-shared"}
    setup = RouterSetup(ctx.policy, ctx.fallback, 4, 4096, auth_yaml(owners), keys["a"])
    folder = ctx.folder(f"burst-{label}")
    with fleet_in(folder) as fleet:
        sims = start_sims(fleet, {f"engine-{n}": SMALL for n in range(2)})
        running = start_router(fleet, sims, folder, setup)
        system = ran_as(running, results, "burst")
        plan = _plan(t, burst, keys)
        ctx.log(f"{system}, {label}: {len(plan)} requests over {plan[-1].at:.0f} s")
        began = time.monotonic()
        watch = QueueWatch()
        done = asyncio.run(_burst_load(running.url, plan, watch))
        seconds = time.monotonic() - began
    window = [t.burst_lead, t.burst_lead + t.burst_s + t.burst_tail]
    b_sent = [
        (s, turn) for item, s, turn in done if item.tenant == "b" and window[0] <= s <= window[1]
    ]
    b_in = [turn for _, turn in b_sent]
    b_timeline = [
        (round(s, 2), None if turn.ttft_ms is None else round(turn.ttft_ms, 1))
        for s, turn in b_sent
    ]
    a_all = [turn for item, _, turn in done if item.tenant == "a"]
    b_ttft = [turn.ttft_ms for turn in b_in if turn.ok and turn.ttft_ms is not None]
    a_ttft = [turn.ttft_ms for turn in a_all if turn.ok and turn.ttft_ms is not None]
    return BurstRun(
        label,
        system,
        "one key for both" if shared else "two tenants",
        BURST_FACTOR * USUAL_RATE if burst else USUAL_RATE,
        window,
        t.burst_lead + t.burst_s,
        len(b_in),
        len(b_in) - len(b_ttft),
        quantile(b_ttft, 0.5),
        quantile(b_ttft, 0.99),
        [round(x, 1) for x in b_ttft],
        len(a_all),
        len(a_all) - len(a_ttft),
        quantile(a_ttft, 0.5),
        quantile(a_ttft, 0.99),
        watch.model_peak,
        watch.global_peak,
        b_timeline,
        round(seconds, 1),
        running.command,
    )


def run_burst(ctx: Context, results: Scenarios) -> None:
    runs = [
        ("baseline", False, False),
        ("burst", True, False),
        ("burst, one key (FIFO)", True, True),
    ]
    for label, burst, shared in runs:
        results.burst.append(burst_run(ctx, results, label, burst, shared))
    base, fair, fifo = results.burst[-3:]
    for run in (fair, fifo):
        ratio = run.b_ttft_p99_ms / base.b_ttft_p99_ms
        measured = f"{run.b_ttft_p99_ms:.0f} ms vs {base.b_ttft_p99_ms:.0f} ms ({ratio:.1f}x)"
        if run is fair:
            results.target(
                "burst", "tenant B TTFT p99, burst vs none", "<= 2x", measured, ratio <= 2
            )
        else:
            print(f"  (for comparison, one key for both: {measured})", flush=True)


SCENARIOS: dict[str, Callable[[Context, Scenarios], None]] = {
    "uniform": run_uniform,
    "failing": run_failing,
    "slowdown": run_slowdown,
    "burst": run_burst,
}
