"""What the routing benchmark's workload and scenarios share: simulators, this router
started with a routing policy (and, if asked, client keys), a streaming client, the
simulators' counters and the router's admin routing table.

A policy the router refuses (a strategy it does not know yet) is retried with a fallback
policy, least-loaded unless told otherwise, and the run says so: see `start_router`.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import re
import secrets
import statistics
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from prometheus_client.parser import text_string_to_metric_families

from bench.common import (
    BIN,
    MODEL,
    Fleet,
    agent_args,
    free_port,
    router_args,
    secret_file,
    wait_http,
)
from bench.peers import Running

# -- the main workload's fleet and sessions ---------------------------------------------------

ENGINES = {
    "fast-big": ["--itl", "4ms", "--prefill-per-token", "0.05ms", "--kv-cache-tokens", "262144"],
    "fast-small": ["--itl", "4ms", "--prefill-per-token", "0.05ms", "--kv-cache-tokens", "16384"],
    "slow-big": ["--itl", "12ms", "--prefill-per-token", "0.15ms", "--kv-cache-tokens", "262144"],
    "slow-small": ["--itl", "12ms", "--prefill-per-token", "0.15ms", "--kv-cache-tokens", "16384"],
}
COMMON = ["--ttft-base", "10ms", "--max-num-seqs", "8", "--max-model-len", "32768"]
OUTPUT_TOKENS = 48
ADMIN_KEY = secrets.token_urlsafe(24)
_JSON = {"Content-Type": "application/json"}


@dataclass(frozen=True)
class Session:
    start: float  # seconds after the run begins
    system_prompt: int
    turns: list[str]
    think: list[float]


def workload(sessions: int, seed: int = 11, gap: float = 20.0) -> tuple[list[str], list[Session]]:
    """Conversations on eight long system prompts, in three bursts `gap` seconds apart."""
    rng = random.Random(seed)
    vocabulary = [f"w{n}" for n in range(5000)]
    prompts = [" ".join(rng.choices(vocabulary, k=800)) for _ in range(8)]
    # Popularity of the system prompts falls off like 1/rank.
    weights = [1 / (rank + 1) for rank in range(len(prompts))]
    bursts = [0.0, gap, 2 * gap]
    out = []
    for n in range(sessions):
        burst = bursts[n * len(bursts) // sessions]
        out.append(
            Session(
                start=burst + rng.uniform(0, 2.0),
                system_prompt=rng.choices(range(len(prompts)), weights)[0],
                turns=[" ".join(rng.choices(vocabulary, k=60)) for _ in range(4)],
                think=[rng.uniform(0.2, 1.5) for _ in range(4)],
            )
        )
    return prompts, out


def random_prompt(rng: random.Random, words: int) -> str:
    """A prompt that shares no prefix with any other (its first word is a fresh number)."""
    return f"{rng.getrandbits(64):x} " + " ".join(f"w{rng.randrange(50_000)}" for _ in range(words))


# -- simulators ------------------------------------------------------------------------------


def start_sims(fleet: Fleet, flags: dict[str, list[str]], seed: int = 3) -> dict[str, str]:
    """One simulator per entry (the key names it); returns name -> base URL, once ready."""
    urls = {}
    for name, extra in flags.items():
        port = free_port()
        args = [str(BIN / "hivenet-sim"), "--port", str(port), "--model", MODEL]
        fleet.start(f"sim-{name}", [*args, "--seed", str(seed), *extra])
        urls[name] = f"http://127.0.0.1:{port}"
    for url in urls.values():
        wait_http(url + "/v1/models", lambda t: MODEL in t)
    return urls


_WANTED = {
    "vllm:prefix_cache_hits_total": "hits",
    "vllm:prefix_cache_queries_total": "queries",
    "vllm:time_to_first_token_seconds_count": "requests",
    "hivenet_sim_requests_total": "received",
}


def parse_counters(text: str) -> dict[str, float]:
    """Prefix-cache hits and queries, requests served (the TTFT histogram's count) and
    requests received (errors included) from a simulator's /metrics."""
    found = dict.fromkeys(_WANTED.values(), 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in _WANTED:
                found[_WANTED[sample.name]] += sample.value
    return found


def engine_counters(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        return parse_counters(resp.read().decode())


_SERVED = re.compile(rb"^vllm:time_to_first_token_seconds_count(?:\{[^}]*\})? (\S+)$", re.M)


async def served(http: aiohttp.ClientSession, url: str) -> float:
    """Requests a simulator has served so far (cheap: one regular expression, no parser)."""
    async with http.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=5)) as reply:
        text = await reply.read()
    return sum(float(m.group(1)) for m in _SERVED.finditer(text))


async def set_faults(http: aiohttp.ClientSession, url: str, faults: dict[str, float]) -> None:
    async with http.post(url + "/admin/faults", data=orjson.dumps(faults), headers=_JSON) as r:
        if r.status != 200:
            raise SystemExit(f"{url}/admin/faults refused {faults}: {await r.text()}")


# -- this router, with a policy --------------------------------------------------------------


@dataclass(frozen=True)
class Policy:
    """A global policy document: one step with this strategy, plus optional YAML."""

    strategy: str
    scoring: str = ""  # a scoring preset (strategy `scored`)
    step_yaml: str = ""  # more fields of the step, indented by two spaces
    top_yaml: str = ""  # more top-level blocks (circuit_breaker, adaptive_concurrency)

    @property
    def label(self) -> str:
        return f"{self.strategy} {self.scoring}".strip()

    def yaml(self) -> str:
        lines = ["routing_policy:", f"  strategy: {self.strategy}"]
        if self.scoring:
            lines += ["  scoring:", f"    preset: {self.scoring}"]
        text = "\n".join(lines) + "\n" + self.step_yaml
        return text + self.top_yaml


@dataclass
class HiveRunning(Running):
    strategy: str = ""  # the strategy the router runs (after any fallback)
    refused: str = ""  # why the asked-for policy was refused, when it was
    asked: str = ""  # the strategy asked for, when it was refused
    policy_yaml: str = ""
    metrics_url: str = ""  # the router's /metrics
    urls: list[str] = field(default_factory=list)  # a site's routers (start_site)
    metrics_urls: list[str] = field(default_factory=list)  # and their /metrics


@dataclass(frozen=True)
class RouterSetup:
    policy: Policy | None = None  # None: no --policy-file (the built-in least-loaded)
    fallback: Policy | None = None  # tried when the router refuses `policy`
    capacity: int = 1024  # per agent
    queue_depth: int = 0  # per-model wait queue; 0 keeps the router's default
    auth_yaml: str = ""  # a static auth.yaml; empty runs without client keys
    client_key: str = ""  # a key of auth_yaml, for the readiness checks


class PolicyRefused(Exception):
    pass


def start_router(
    fleet: Fleet, engines: dict[str, str], folder: Path, setup: RouterSetup
) -> HiveRunning:
    """This router and one agent per engine (labelled `--machine NAME`), in `folder`.
    A policy the router refuses is run as `setup.fallback` instead (PolicyRefused without
    one); the returned HiveRunning then says why in `refused`."""
    try:
        return _start_router(fleet, engines, folder, setup.policy, setup)
    except PolicyRefused as refused:
        if setup.fallback is None:
            raise
        running = _start_router(fleet, engines, folder / "fallback", setup.fallback, setup)
        running.refused = str(refused)
        running.asked = setup.policy.label if setup.policy else "least-loaded"
        running.command += f" [asked for {running.asked}: refused]"
        return running


def _start_router(
    fleet: Fleet, engines: dict[str, str], folder: Path, policy: Policy | None, setup: RouterSetup
) -> HiveRunning:
    folder.mkdir(parents=True, exist_ok=True)
    secret = secret_file(folder)
    http, grpc = free_port(), free_port()
    extra = ["--max-concurrent", "2048", "--queue-size", "8192"]
    if setup.queue_depth:
        extra += ["--queue-depth", str(setup.queue_depth)]
    if policy is not None:
        (folder / "policy.yaml").write_text(policy.yaml())
        extra += ["--policy-file", str(folder / "policy.yaml")]
    if setup.auth_yaml:
        (folder / "auth.yaml").write_text(setup.auth_yaml)
        extra += ["--auth-config-file", str(folder / "auth.yaml")]
    env = {"HIVENET_ROUTER_ADMIN_API_KEYS": ADMIN_KEY}
    args = router_args(secret, folder / "store", http, grpc, *extra)
    metrics_url = f"http://{args[args.index('--metrics-port') + 1]}/metrics"
    fleet.start("hivenet", args, env)
    names = ["hivenet"]
    for name, engine in engines.items():
        flags = ("--capacity", str(setup.capacity), "--machine", name)
        args = agent_args(secret, grpc, engine, folder / f"agent-{name}.key", *flags)
        fleet.start(f"hivenet-agent-{name}", args)
        names.append(f"hivenet-agent-{name}")
    url = f"http://127.0.0.1:{http}"
    try:
        _wait_router(fleet, url, len(engines), setup.client_key)
    except PolicyRefused:
        fleet.stop(names)
        raise
    strategy = policy.label if policy else "least-loaded"
    command = "hivenet-router --max-concurrent 2048 --queue-size 8192"
    command += f" --queue-depth {setup.queue_depth}" if setup.queue_depth else ""
    command += f" --policy-file P ({strategy})" if policy else " (least-loaded, the default)"
    command += " --auth-config-file A" if setup.auth_yaml else ""
    command += f" + {len(engines)} x hivenet-agent --capacity {setup.capacity}"
    policy_yaml = policy.yaml() if policy else ""
    return HiveRunning(url, names, command, strategy, "", policy_yaml, metrics_url=metrics_url)


def start_site(
    fleet: Fleet, engines: dict[str, str], folder: Path, policy: Policy, routers: int
) -> HiveRunning:
    """`routers` routers of one site (one JWT secret, each its own --router-id) with
    `policy`, and one agent per engine serving them all (--routers): each agent reports its
    engine's prefix blocks to every router. `urls` lists the routers' addresses; the
    clients spread a conversation's turns over them."""
    folder.mkdir(parents=True, exist_ok=True)
    secret = secret_file(folder)
    (folder / "policy.yaml").write_text(policy.yaml())
    ports = [(free_port(), free_port()) for _ in range(routers)]
    names: list[str] = []
    metrics: list[str] = []
    for n, (http, grpc) in enumerate(ports):
        extra = ["--max-concurrent", "2048", "--queue-size", "8192"]
        extra += ["--policy-file", str(folder / "policy.yaml"), "--router-id", f"r{n}"]
        extra += ["--advertise-grpc-addr", f"127.0.0.1:{grpc}"]
        args = router_args(secret, folder / f"store-{n}", http, grpc, *extra)
        metrics.append(f"http://{args[args.index('--metrics-port') + 1]}/metrics")
        name = "hivenet" if n == 0 else f"hivenet-{n}"
        fleet.start(name, args, {"HIVENET_ROUTER_ADMIN_API_KEYS": ADMIN_KEY})
        names.append(name)
    listed = ",".join(f"127.0.0.1:{grpc}" for _, grpc in ports)
    for name, engine in engines.items():
        flags = ("--capacity", "1024", "--machine", name, "--routers", listed)
        args = agent_args(secret, ports[0][1], engine, folder / f"agent-{name}.key", *flags)
        fleet.start(f"hivenet-agent-{name}", args)
        names.append(f"hivenet-agent-{name}")
    urls = [f"http://127.0.0.1:{http}" for http, _ in ports]
    for n, url in enumerate(urls):
        _wait_router(fleet, url, len(engines), "", process=names[n])
    command = (
        f"{routers} x hivenet-router --max-concurrent 2048 --queue-size 8192 --policy-file P "
        f"({policy.label}) --router-id rN + {len(engines)} x hivenet-agent --capacity 1024 "
        "--routers (all of them)"
    )
    running = HiveRunning(urls[0], names, command, policy.label, "", policy.yaml(), metrics[0])
    running.urls = urls
    running.metrics_urls = metrics
    return running


def _wait_router(
    fleet: Fleet, url: str, agents: int, key: str, timeout: float = 60.0, process: str = "hivenet"
) -> None:
    """Ready: every agent healthy in /v1/models and a chat completion answered. A router
    that exits first refused its configuration: PolicyRefused with its last log line."""
    headers = {**_JSON, **({"Authorization": f"Bearer {key}"} if key else {})}
    replicas = f'"healthy_replicas":{agents}'
    body = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    deadline = time.monotonic() + timeout
    ready = False
    while time.monotonic() < deadline:
        if fleet.procs[process].poll() is not None:
            log = (fleet.tmp / f"{process}.log").read_text(errors="replace").strip()
            raise PolicyRefused(log.splitlines()[-1] if log else "exited without a word")
        try:
            if not ready:
                request = urllib.request.Request(url + "/v1/models", headers=headers)
                with urllib.request.urlopen(request, timeout=2) as reply:
                    ready = replicas in reply.read().decode()
            else:
                request = urllib.request.Request(url + "/v1/chat/completions", body, headers)
                with urllib.request.urlopen(request, timeout=5) as reply:
                    if reply.status == 200:
                        return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{url} was not ready within {timeout:.0f}s (see {fleet.tmp})")


def auth_yaml(owners: dict[str, str], weights: dict[str, int] | None = None) -> str:
    """A static auth.yaml: one client key per entry (raw key -> owner); `weights` gives an
    owner a quota.queue_weight (left out when None, so the router's default holds)."""
    lines = ["api:", "  mode: api-key", "  keys:"]
    for n, (key, owner) in enumerate(owners.items()):
        lines.append(f'    - key_hash: "{hashlib.sha256(key.encode()).hexdigest()}"')
        lines.append(f'      metadata: {{name: "bench {n}", owner: "{owner}"}}')
        if weights and owner in weights:
            lines.append(f"      quota: {{queue_weight: {weights[owner]}}}")
    return "\n".join([*lines, "admin:", "  mode: api-key", ""])


async def admin_get(http: aiohttp.ClientSession, url: str, path: str) -> dict[str, Any]:
    """An admin endpoint's JSON object ({} when the router says anything but 200)."""
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    timeout = aiohttp.ClientTimeout(total=2)
    async with http.get(url + path, headers=headers, timeout=timeout) as reply:
        data = orjson.loads(await reply.read()) if reply.status == 200 else {}
    return data if isinstance(data, dict) else {}


async def routing_table(http: aiohttp.ClientSession, url: str) -> list[dict[str, Any]]:
    agents = (await admin_get(http, url, "/admin/routing-table")).get("agents")
    return agents if isinstance(agents, list) else []


# -- the client ------------------------------------------------------------------------------


@dataclass
class Turn:
    status: int  # the HTTP status; 0 when the connection failed or the stream broke
    ttft_ms: float | None = None  # to the first content chunk
    tokens: int = 0
    text: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.ttft_ms is not None


def chat_body(messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": messages,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def stream_chat(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], key: str = ""
) -> Turn:
    headers = {**_JSON, **({"Authorization": f"Bearer {key}"} if key else {})}
    started = time.monotonic()
    text: list[str] = []
    turn = Turn(0)
    try:
        async with http.post(url, data=orjson.dumps(body), headers=headers) as reply:
            turn.status = reply.status
            if reply.status != 200:
                await reply.read()
                return turn
            async for raw in reply.content:
                line = raw.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                chunk = orjson.loads(line[5:])
                if chunk.get("usage"):
                    turn.tokens += int(chunk["usage"].get("completion_tokens", 0))
                for choice in chunk.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        if turn.ttft_ms is None:
                            turn.ttft_ms = (time.monotonic() - started) * 1000
                        text.append(piece)
    except (aiohttp.ClientError, TimeoutError, ValueError):
        turn.status = 0
    turn.text = "".join(text)
    return turn


@dataclass
class Outcome:
    ttft_ms: list[float] = field(default_factory=list)
    output_tokens: int = 0
    completed: int = 0
    errors: int = 0

    def add(self, turn: Turn) -> None:
        if turn.ok and turn.ttft_ms is not None:
            self.ttft_ms.append(turn.ttft_ms)
            self.output_tokens += turn.tokens
            self.completed += 1
        else:
            self.errors += 1


def client(timeout: float = 120.0) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=timeout), connector=aiohttp.TCPConnector(limit=0)
    )


async def closed_loop(
    url: str, workers: int, seconds: float, words: int, max_tokens: int, seed: int
) -> Outcome:
    """`workers` clients, each sending one random-prompt request after another until
    `seconds` have passed (and at most 100 requests per second each)."""
    outcome = Outcome()
    deadline = time.monotonic() + seconds

    async def worker(http: aiohttp.ClientSession, n: int) -> None:
        rng = random.Random(seed * 1000 + n)
        for _ in range(int(seconds * 100)):
            if time.monotonic() >= deadline:
                return
            prompt = random_prompt(rng, words)
            body = chat_body([{"role": "user", "content": prompt}], max_tokens)
            outcome.add(await stream_chat(http, url, body))

    async with client() as http:
        await asyncio.gather(*(worker(http, n) for n in range(workers)))
    return outcome


async def run_session(
    http: aiohttp.ClientSession,
    url: str | list[str],
    prompt: str,
    session: Session,
    outcome: Outcome,
    began: float,
    bar: Any,
    first: int = 0,
) -> None:
    """One conversation; with several `url`s (a site's routers) its turns go to each in
    turn, starting at the `first`."""
    urls = [url] if isinstance(url, str) else url
    await asyncio.sleep(max(0.0, began + session.start - time.monotonic()))
    messages = [{"role": "system", "content": prompt}]
    for number, (turn, think) in enumerate(zip(session.turns, session.think, strict=True)):
        messages.append({"role": "user", "content": turn})
        at = urls[(first + number) % len(urls)]
        answer = await stream_chat(http, at, chat_body(messages, OUTPUT_TOKENS))
        outcome.add(answer)
        messages.append({"role": "assistant", "content": answer.text if answer.ok else ""})
        if bar is not None:
            bar.update()
        await asyncio.sleep(think)


async def drive(
    url: str | list[str], prompts: list[str], sessions: list[Session], bar: Any = None
) -> tuple[Outcome, float]:
    """Every session at its time, each turn after the last one's answer and think time;
    with several `url`s, turns alternate between them (each session starting elsewhere)."""
    outcome = Outcome()
    async with client() as http:
        began = time.monotonic()
        await asyncio.gather(
            *(
                run_session(http, url, prompts[s.system_prompt], s, outcome, began, bar, n)
                for n, s in enumerate(sessions)
            )
        )
        return outcome, time.monotonic() - began


def quantile(values: list[float], q: float) -> float:
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]
