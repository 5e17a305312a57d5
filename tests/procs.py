"""Start the project's programs as real processes on free loopback ports, for tests."""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anthropic
import httpx2 as httpx
import openai
import orjson
import pytest

from tests.ports import free_port

BIN = Path(sys.executable).parent
ADMIN_KEY = "test-admin-key-0123456789"
PRLIMIT = shutil.which("prlimit") or "prlimit"


@dataclass
class Proc:
    name: str
    args: list[str]
    log_path: Path
    popen: subprocess.Popen[bytes] | None = None
    env: dict[str, str] = field(default_factory=dict)
    open_files: int = 0  # the process's descriptor limit (soft and hard); 0: inherited

    def start(self) -> Proc:
        handle = self.log_path.open("ab")
        program = self.args[0] if os.path.isabs(self.args[0]) else str(BIN / self.args[0])
        # util-linux's prlimit sets the limit before the program starts (no preexec_fn,
        # which is unsafe beside threads).
        limit = [PRLIMIT, f"--nofile={self.open_files}", "--"] if self.open_files else []
        self.popen = subprocess.Popen(
            [*limit, program, *self.args[1:]],
            stdout=handle,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env},
        )
        handle.close()
        return self

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
        if self.popen is None or self.popen.poll() is not None:
            return
        self.popen.send_signal(sig)
        try:
            self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(timeout=5)

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def wait_until(predicate: object, timeout: float = 15.0, interval: float = 0.05) -> None:
    """Poll `predicate` until it returns truthy; fail the test after `timeout` seconds."""
    assert callable(predicate)
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
            if last:
                return
        except (httpx.HTTPError, OSError) as exc:
            last = exc
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout}s (last: {last!r})")


def metric(text: str, name: str, **labels: str) -> float | None:
    """Sum of a metric's samples whose labels include `labels`; None when there is no such
    series at all, so a renamed or missing metric fails a check instead of reading as 0."""
    total = 0.0
    found = False
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        match = re.match(rf"^{re.escape(name)}(\{{.*\}})? (\S+)$", line)
        if not match:
            continue
        label_text = match.group(1) or ""
        if all(f'{k}="{v}"' in label_text for k, v in labels.items()):
            total += float(match.group(2))
            found = True
    return total if found else None


@dataclass
class Sim:
    proc: Proc
    port: int
    model: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=5).text

    def set_faults(self, **faults: float) -> None:
        httpx.post(self.url + "/admin/faults", json=faults, timeout=5).raise_for_status()


@dataclass
class Router:
    proc: Proc
    http: int
    grpc: int
    p2p: int
    metrics_port: int
    audit: Path | None = None  # where its audit records go, as the harness set it

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http}"

    def metrics(self) -> str:
        return httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).text

    def audit_records(self) -> list[dict[str, Any]]:
        """The audit records written so far. A line still being written (the writer thread
        appends while a test reads) is left for the next read."""
        if self.audit is None or not self.audit.exists():
            return []
        *whole, _unfinished = self.audit.read_bytes().split(b"\n")
        return [orjson.loads(line) for line in whole if line]

    def models(self) -> list[str]:
        data = httpx.get(self.url + "/v1/models", timeout=5).json()["data"]
        return [m["id"] for m in data]

    def openai(self, key: str = "x", retries: int = 0) -> openai.OpenAI:
        """The official OpenAI SDK pointed at this router (use as a context manager)."""
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=retries)

    def anthropic(self, key: str = "x", retries: int = 0) -> anthropic.Anthropic:
        """The official Anthropic SDK pointed at this router (use as a context manager)."""
        return anthropic.Anthropic(base_url=self.url, api_key=key, max_retries=retries)

    def healthy_replicas(self, model: str) -> int:
        data = httpx.get(self.url + "/v1/models", timeout=5).json()["data"]
        return sum(m["healthy_replicas"] for m in data if m["id"] == model)


@dataclass
class Cluster:
    """Processes of one test; `close` stops them all and the test prints their logs on failure."""

    tmp: Path
    secret_file: Path
    procs: list[Proc] = field(default_factory=list)

    def _proc(
        self, name: str, args: list[str], env: dict[str, str] | None = None, open_files: int = 0
    ) -> Proc:
        proc = Proc(name, args, self.tmp / f"{name}.log", env=env or {}, open_files=open_files)
        proc.start()
        self.procs.append(proc)
        return proc

    def spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> Proc:
        """Start any program (an absolute path, or one of this venv's commands)."""
        return self._proc(name, args, env)

    def sim(
        self,
        model: str = "sim-model",
        *extra: str,
        name: str = "sim",
        port: int = 0,
        api_key: str = "",
    ) -> Sim:
        """A simulator; with `api_key` it refuses requests without that bearer key, as an
        engine started with --api-key does."""
        port = port or free_port()
        if api_key:
            extra = (*extra, "--api-key", api_key)
        ready = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        proc = self._proc(
            name,
            [
                "hivenet-sim",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--model",
                model,
                "--seed",
                "7",
                *extra,
            ],
        )
        sim = Sim(proc, port, model)
        wait_until(
            lambda: httpx.get(sim.url + "/health", headers=ready, timeout=1).status_code == 200
        )
        return sim

    def router(
        self,
        *extra: str,
        name: str = "router",
        ports: Router | None = None,
        env: dict[str, str] | None = None,
        wait: bool = True,
        open_files: int = 0,
    ) -> Router:
        """Start a router; unless `wait` is False, return once `/health` answers.
        `open_files` sets its descriptor limit (0: this process's)."""
        http, grpc, p2p, met = (
            (ports.http, ports.grpc, ports.p2p, ports.metrics_port)
            if ports
            else (free_port(), free_port(), free_port(), free_port())
        )
        proc = self._proc(
            name,
            [
                "hivenet-router",
                "--http-port",
                f"127.0.0.1:{http}",
                "--grpc-port",
                f"127.0.0.1:{grpc}",
                "--metrics-port",
                f"127.0.0.1:{met}",
                "--p2p-port",
                str(p2p),
                "--jwt-secret-file",
                str(self.secret_file),
                "--health-check-interval",
                "200ms",
                "--heartbeat-interval",
                "300ms",
                "--unhealthy-after",
                "3s",
                "--remove-after",
                "5s",
                "--disk-db-path",
                str(self.tmp / f"{name}-store"),
                # Tests ask for unknown models on purpose; the warm-up has its own test.
                "--warmup",
                "0s",
                *extra,
            ],
            {
                "HIVENET_ROUTER_ADMIN_API_KEYS": ADMIN_KEY,
                "HIVENET_ROUTER_AUDIT_LOG_PATH": str(self.tmp / f"{name}-audit.jsonl"),
                **(env or {}),
            },
            open_files,
        )
        router = Router(proc, http, grpc, p2p, met, self.tmp / f"{name}-audit.jsonl")
        if wait:
            wait_until(lambda: httpx.get(router.url + "/health", timeout=1).status_code == 200)
        return router

    def agent(
        self,
        router: Router,
        sim: Sim | None,
        *extra: str,
        name: str = "agent",
        backend_url: str | None = None,
        wait: bool = True,
        env: dict[str, str] | None = None,
    ) -> Proc:
        backend = backend_url or (sim.url if sim else "")
        proc = self._proc(
            name,
            [
                "hivenet-agent",
                "--backend-url",
                backend,
                "--router-grpc",
                f"127.0.0.1:{router.grpc}",
                "--jwt-secret-file",
                str(self.secret_file),
                "--identity-path",
                str(self.tmp / f"{name}.key"),
                "--reconnect-delay",
                "200ms",
                "--routing-signal-interval",
                "200ms",
                "--engine-sample-interval",
                "200ms",
                "--backend-check-interval",
                "200ms",
                *extra,
            ],
            env,
        )
        return proc

    def refused_router(self, *extra: str, env: dict[str, str] | None = None) -> str:
        """Start a router that must refuse to start (exit status 2); return its log."""
        proc = self._proc(
            "refused-router",
            [
                "hivenet-router",
                "--jwt-secret-file",
                str(self.secret_file),
                "--http-port",
                "127.0.0.1:0",
                *extra,
            ],
            env,
        )
        assert proc.popen is not None and proc.popen.wait(timeout=20) == 2
        return proc.log()

    def close(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()

    def logs(self) -> str:
        return "\n".join(f"===== {p.name} =====\n{p.log()[-6000:]}" for p in self.procs)


@contextmanager
def cluster(tmp: Path) -> Iterator[Cluster]:
    secret = tmp / "jwt.secret"
    fd = os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(secrets.token_urlsafe(48))
    c = Cluster(tmp, secret)
    try:
        yield c
    except BaseException:
        print(c.logs())
        raise
    finally:
        c.close()


def wait_registered(router: Router, model: str, replicas: int = 1, timeout: float = 20) -> None:
    wait_until(lambda: router.healthy_replicas(model) >= replicas, timeout=timeout)


def break_stream(
    client: openai.OpenAI, model: str, kill: Callable[[], None], max_tokens: int = 100
) -> None:
    """Stream a chat answer, call `kill` at the third chunk, and expect the SDK to raise
    the router's "stream interrupted" error rather than end quietly or hang."""
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=max_tokens,
        stream=True,
    )
    seen = 0
    with pytest.raises(openai.APIError, match="stream interrupted"):
        for _chunk in stream:
            seen += 1
            if seen == 3:
                kill()
    assert seen >= 3


def survivor_serves(router: Router, client: openai.OpenAI, model: str) -> None:
    """After one of two replicas died: the router drops it, the other answers, and nothing
    is left held."""
    wait_until(lambda: router.healthy_replicas(model) == 1, timeout=15)
    for _ in range(2):
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Again."}], max_tokens=3
        )
        assert reply.usage is not None and reply.usage.completion_tokens > 0
    text = router.metrics()
    assert metric(text, "hivenet_router_active_forwards") == 0.0
    assert metric(text, "hivenet_agent_capacity_utilization") == 0.0


def sync_view(router: Router) -> dict[str, Any]:
    """The router's GET /admin/sync: what it knows of its site (docs/site.md)."""
    answer = httpx.get(
        router.url + "/admin/sync", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=5
    )
    answer.raise_for_status()
    view: dict[str, Any] = answer.json()
    return view
