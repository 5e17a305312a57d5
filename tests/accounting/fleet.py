"""The site the accounting checker runs against, and the faults it suffers.

Everything on loopback: a Valkey primary with two replicas and three Sentinels, a
PostgreSQL ledger, three routers sharing limits through the store (`--sync-sentinels`) and
billing to the ledger, three simulators that log their own count of every request
(`--usage-log`), and three agents, each connected to every router. Twenty tenants, each an
API key whose owner is the tenant, with a request rate, input and output token rates, a
daily token budget and a wallet; half the tenants have one of these set tight so that it is
reached.

Faults (each waits for the state it leads to, never for a fixed time): a router killed with
SIGKILL and started again under its ID and ports; the Valkey primary killed and a replica
promoted by the Sentinels; PostgreSQL killed with SIGKILL and started again; an agent
killed with SIGKILL and started again.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path

import httpx2 as httpx

from tests.postgres import Postgres, postgres_server
from tests.procs import (
    ADMIN_KEY,
    Cluster,
    Proc,
    Router,
    Sim,
    cluster,
    metric,
    sync_view,
    wait_until,
)
from tests.valkey_site import ValkeySite

MODEL = "acct"
SITE = "acct"
ROUTERS = 3
SYNC_INTERVAL = 0.25  # seconds: one sync round (--sync-interval)
# The policy every request meets (docs/admission.md, docs/wallets.md, docs/cache.md).
MAX_INPUT = 150  # max_input_tokens: an input token rate must be at least this
DEFAULT_MAX_TOKENS = 48  # the output bound of a request that declares none
NATURAL = 24  # the simulator's answer length when the router set the bound (--output-tokens)
ADMIT_BUDGET = 6000  # admit_budget_tokens per replica
PRICE_IN = Decimal("0.001")  # USD per input token (1,000 per million)
PRICE_OUT = Decimal("0.002")
ITL_MS = 6  # the simulator's time per output token: streams last long enough to be cut


@dataclass(frozen=True)
class Tenant:
    name: str
    secret: str
    rpm: int
    itpm: int
    otpm: int
    daily: int
    credit: Decimal

    @property
    def tight(self) -> str:
        """Which limit is set to be reached: wallet, rpm, itpm, otpm, daily, or none."""
        kind = int(self.name[1:]) % 10
        return ("wallet", "rpm", "itpm", "otpm", "daily")[kind] if kind < 5 else "none"


def make_tenants(count: int = 20) -> list[Tenant]:
    """`count` tenants t00, t01...: of every ten, the first five have one limit each set
    tight (wallet, rpm, itpm, otpm, daily, in that order), the other five none."""
    tenants = []
    for index in range(count):
        kind = index % 10
        tenants.append(
            Tenant(
                name=f"t{index:02d}",
                secret=f"sk-hivenet-acct-{index:02d}-0123456789",
                rpm=6 if kind == 1 else 600,
                itpm=MAX_INPUT if kind == 2 else 20_000,
                otpm=120 if kind == 3 else 20_000,
                daily=400 if kind == 4 else 100_000,
                credit=Decimal("0.3") if kind == 0 else Decimal("50"),
            )
        )
    return tenants


def write_config(tmp: Path, tenants: list[Tenant]) -> tuple[Path, Path]:
    auth = tmp / "auth.yaml"
    keys = "".join(
        f'    - key_hash: "{hashlib.sha256(t.secret.encode()).hexdigest()}"\n'
        f"      metadata: {{name: k-{t.name}, owner: {t.name}}}\n"
        f"      quota: {{requests_per_minute: {t.rpm}, input_tokens_per_minute: {t.itpm},"
        f" output_tokens_per_minute: {t.otpm}, tokens_per_day: {t.daily}}}\n"
        for t in tenants
    )
    auth.write_text(f"api:\n  mode: api-key\n  keys:\n{keys}admin:\n  mode: api-key\n")
    policy = tmp / "policy.yaml"
    policy.write_text(
        "mode: serverless\n"
        f"max_input_tokens: {MAX_INPUT}\n"
        f"default_max_tokens: {DEFAULT_MAX_TOKENS}\n"
        f"admit_budget_tokens: {ADMIT_BUDGET}\n"
        f"prices: {{currency: USD, input_per_million: {PRICE_IN * 1_000_000},"
        f" output_per_million: {PRICE_OUT * 1_000_000}}}\n"
        # Hits are not billed: the ledger then equals what the engines generated.
        "response_cache: {bill_hits: false}\n"
        "routing_policy: {strategy: least-loaded}\n"
    )
    return auth, policy


@dataclass(frozen=True)
class Life:
    """One process of router `index`: from `began` until `killed` (SIGKILL), monotonic."""

    index: int
    began: float
    killed: float | None = None


@dataclass
class Fleet:
    tmp: Path
    cluster: Cluster
    store: ValkeySite
    pg: Postgres
    tenants: list[Tenant]
    flags: list[str] = field(default_factory=list)
    routers: list[Router] = field(default_factory=list)
    sims: list[Sim] = field(default_factory=list)
    agents: list[Proc] = field(default_factory=list)
    lives: list[Life] = field(default_factory=list)  # every router process, in order
    faults: list[tuple[str, float, float]] = field(default_factory=list)  # what, from, to
    agent_kills: list[tuple[int, float]] = field(default_factory=list)  # (agent, when killed)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def usage_logs(self) -> list[Path]:
        return [self.tmp / f"sim{i}-usage.jsonl" for i in range(len(self.sims))]

    @property
    def audit_logs(self) -> list[Path]:
        return [self.tmp / f"router{i}-audit.jsonl" for i in range(ROUTERS)]

    # -- start ----------------------------------------------------------------------------------

    def start(self) -> None:
        auth, policy = write_config(self.tmp, self.tenants)
        self.flags = [
            *("--auth-config-file", str(auth), "--policy-file", str(policy)),
            *("--sync-store", "valkey", "--sync-sentinels", ",".join(self.store.sentinel_addrs)),
            *("--sync-master", self.store.master_name, "--sync-site", SITE),
            *("--sync-interval", f"{int(SYNC_INTERVAL * 1000)}ms"),
            *("--sync-min-routers", str(ROUTERS)),
            *("--ledger-dsn", self.pg.dsn(), "--ledger-timeout", "1s"),
        ]
        for index in range(ROUTERS):
            self.routers.append(self._router(index))
        for index in range(ROUTERS):
            log = self.tmp / f"sim{index}-usage.jsonl"
            timing = ("--itl", f"{ITL_MS}ms", "--ttft-base", "0", "--output-tokens", str(NATURAL))
            self.sims.append(
                self.cluster.sim(
                    MODEL,
                    *timing,
                    "--usage-log",
                    str(log),
                    "--seed",
                    str(7 + index),
                    name=f"sim{index}",
                )
            )
            self.agents.append(self._agent(index))
        self.ready()
        for tenant in self.tenants:
            answer = self.admin(
                0,
                "POST",
                f"/admin/wallets/{tenant.name}/credit",
                {"amount": str(tenant.credit), "reference": f"start-{tenant.name}"},
            )
            assert answer.status_code == 200, answer.text

    def _router(self, index: int, ports: Router | None = None) -> Router:
        began = time.monotonic()
        router = self.cluster.router(
            *self.flags, "--router-id", f"r{index}", name=f"router{index}", ports=ports
        )
        with self.lock:
            self.lives.append(Life(index, began))
        return router

    def _agent(self, index: int) -> Proc:
        everyone = ",".join(f"127.0.0.1:{r.grpc}" for r in self.routers)
        return self.cluster.agent(
            self.routers[0], self.sims[index], "--routers", everyone, "--capacity", "64",
            name=f"agent{index}",
        )  # fmt: skip

    def ready(self, agents: int = ROUTERS, timeout: float = 30.0) -> None:
        """Every router sees `agents` healthy agents, the other routers and the store."""
        ids = [f"r{i}" for i in range(ROUTERS)]
        for router in self.routers:
            wait_until(
                lambda r=router: metric(r.metrics(), "hivenet_routing_agent_healthy") == agents,
                timeout=timeout,
            )
            wait_until(
                lambda r=router: (v := sync_view(r))["routers"] == ids and v["store_up"],
                timeout=timeout,
            )

    def admin(self, index: int, method: str, path: str, body: object = None) -> httpx.Response:
        return httpx.request(
            method,
            self.routers[index].url + path,
            json=body,
            headers={"Authorization": f"Bearer {ADMIN_KEY}"},
            timeout=10,
        )

    # -- faults ---------------------------------------------------------------------------------

    def kill_router(self, index: int) -> None:
        """SIGKILL router `index`, then start it again on its ports under its ID."""
        began = time.monotonic()
        self.routers[index].proc.kill()
        with self.lock:
            for at, life in enumerate(self.lives):
                if life.index == index and life.killed is None:
                    self.lives[at] = Life(index, life.began, began)
        self.routers[index] = self._router(index, ports=self.routers[index])
        self.ready()
        self.faults.append((f"router r{index} kill -9, restart", began, time.monotonic()))

    def fail_over(self) -> None:
        """SIGKILL the Valkey primary; wait for the Sentinels' new one and the routers."""
        began = time.monotonic()
        old = self.store.kill_primary()
        new = self.store.wait_for_new_primary(old, timeout=30)
        self.ready()
        self.faults.append((f"valkey primary kill -9 ({old} -> {new})", began, time.monotonic()))

    def kill_ledger(self) -> float:
        began = time.monotonic()
        self.pg.kill()
        return began

    def restart_ledger(self, began: float) -> None:
        self.pg.start()
        for router in self.routers:
            wait_until(lambda r=router: metric(r.metrics(), "hivenet_ledger_up") == 1.0, 30)
        self.faults.append(("postgresql kill -9, restart", began, time.monotonic()))

    def kill_agent(self, index: int) -> None:
        """SIGKILL agent `index`; once every router dropped it, start it again."""
        began = time.monotonic()
        self.agents[index].kill()
        self.agent_kills.append((index, began))
        self.ready(agents=ROUTERS - 1)
        self.agents[index] = self._agent(index)
        self.ready()
        self.faults.append((f"agent a{index} kill -9, restart", began, time.monotonic()))

    # -- after the traffic ----------------------------------------------------------------------

    def settle(self, timeout: float = 60.0) -> None:
        """Wait until nothing runs anywhere: engines idle, no forward, reservation or
        pending charge on any router, the ledger up everywhere."""
        for sim in self.sims:
            wait_until(lambda s=sim: _idle(s.metrics()), timeout=timeout)
        for router in self.routers:
            wait_until(lambda r=router: _quiet(r.metrics()), timeout=timeout)


def _idle(text: str) -> bool:
    return (metric(text, "vllm:num_requests_running") or 0.0) == 0.0 and (
        metric(text, "vllm:num_requests_waiting") or 0.0
    ) == 0.0


# Gauges that must read zero on an idle router (docs/observability.md, docs/wallets.md).
HELD_GAUGES = (
    "hivenet_router_active_forwards",
    "hivenet_router_pending_requests",
    "hivenet_admission_inflight_requests",
    "hivenet_admission_occupancy_tokens",
    "hivenet_wallet_pending_charges",
    "hivenet_agent_capacity_utilization",
)


def held(text: str) -> dict[str, float]:
    """The gauges of HELD_GAUGES that are not zero (absent ones read as zero)."""
    return {name: v for name in HELD_GAUGES if (v := metric(text, name) or 0.0) != 0.0}


def _quiet(text: str) -> bool:
    return not held(text) and metric(text, "hivenet_ledger_up") == 1.0


@contextmanager
def started(tmp: Path, tenants: list[Tenant]) -> Iterator[Fleet]:
    with (
        ValkeySite(tmp / "valkey", replicas=2, sentinels=3) as store,
        postgres_server() as pg,
        cluster(tmp) as procs,
    ):
        fleet = Fleet(tmp, procs, store, pg, tenants)
        fleet.start()
        yield fleet
