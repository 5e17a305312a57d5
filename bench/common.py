"""What the benchmarks share: processes on loopback, wrk, CPU and memory accounting, venvs."""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil
from tests.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
RESULTS = ROOT / "bench" / "results"
DOC = ROOT / "docs" / "benchmarks.md"
CACHE = Path(os.environ.get("HIVENET_CACHE", Path.home() / ".cache" / "hivenet-router"))
MODEL = "bench-model"
CHAT: dict[str, object] = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}]}
LOADS: dict[str, dict[str, object]] = {
    # ~1 KB JSON answer (130 tokens of the simulator's words)
    "json-1k": {**CHAT, "max_tokens": 130},
    # 50 content chunks plus the role, finish and [DONE] events
    "sse-50": {**CHAT, "max_tokens": 50, "stream": True},
    # the same stream with the client asking for usage (stream_options.include_usage): an
    # answer every version of the router meters, for comparing the meter's cost
    "sse-50-usage": {
        **CHAT,
        "max_tokens": 50,
        "stream": True,
        "stream_options": {"include_usage": True},
    },
}


def cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def _tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def tree_cpu_seconds(pids: list[int]) -> float:
    """User plus system CPU of these processes and all their children."""
    total = 0.0
    for pid in pids:
        for proc in _tree(pid):
            try:
                times = proc.cpu_times()
                total += times.user + times.system
            except psutil.NoSuchProcess:
                pass
    return total


def tree_run_queue_seconds(pids: list[int]) -> float:
    """Time the threads of these process trees spent runnable but waiting for a CPU (the
    second field of /proc/PID/task/TID/schedstat). A thread that ended meanwhile takes its
    share with it, which the long-lived processes measured here do not do."""
    total = 0
    for pid in pids:
        for proc in _tree(pid):
            tasks = Path(f"/proc/{proc.pid}/task")
            try:
                tids = [entry.name for entry in tasks.iterdir()]
            except OSError:
                continue
            for tid in tids:
                try:
                    fields = (tasks / tid / "schedstat").read_text().split()
                except OSError:
                    continue
                total += int(fields[1]) if len(fields) > 1 else 0
    return total / 1e9


def cpu_pressure_seconds() -> float:
    """The machine's time during which at least one thread waited for a CPU (Linux's
    pressure stall information, "some" line of /proc/pressure/cpu); NaN where the kernel
    does not keep it."""
    try:
        line = Path("/proc/pressure/cpu").read_text().splitlines()[0]
    except (OSError, IndexError):
        return math.nan
    total = line.rpartition("total=")[2]
    return int(total) / 1e6 if total.isdigit() else math.nan


def tree_peak_rss_mb(pids: list[int]) -> float:
    """Sum of each process's peak resident set (VmHWM) over these process trees."""
    total_kb = 0
    for pid in pids:
        for proc in _tree(pid):
            try:
                status = Path(f"/proc/{proc.pid}/status").read_text()
            except OSError:
                continue
            match = re.search(r"^VmHWM:\s+(\d+) kB", status, re.M)
            total_kb += int(match.group(1)) if match else 0
    return total_kb / 1024


def tree_pss_mb(pids: list[int]) -> float:
    """Proportional set size of these process trees: private pages, plus each shared page
    divided among the processes that map it (so libraries loaded by the router and both
    agents count once, not three times)."""
    total_kb = 0
    for pid in pids:
        for proc in _tree(pid):
            try:
                rollup = Path(f"/proc/{proc.pid}/smaps_rollup").read_text()
            except OSError:
                continue
            match = re.search(r"^Pss:\s+(\d+) kB", rollup, re.M)
            total_kb += int(match.group(1)) if match else 0
    return total_kb / 1024


class PeakPss:
    """Samples the PSS of process trees on a thread (every `period` s); keeps the peak."""

    def __init__(self, pids: list[int], period: float = 0.25) -> None:
        self.pids = pids
        self.peak = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(period,), daemon=True)
        self._thread.start()

    def _run(self, period: float) -> None:
        while not self._stop.wait(period):
            self.peak = max(self.peak, tree_pss_mb(self.pids))

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak


def idle_cpu_percent(pids: dict[str, int], seconds: float) -> dict[str, float]:
    """Percent of one core each process (tree) used over `seconds` of doing nothing."""
    before = {name: tree_cpu_seconds([pid]) for name, pid in pids.items()}
    time.sleep(seconds)
    return {
        name: round(100 * (tree_cpu_seconds([pid]) - before[name]) / seconds, 3)
        for name, pid in pids.items()
    }


def ensure_wrk() -> str:
    path = shutil.which("wrk")
    if path:
        return path
    print("installing wrk with apt-get ...", flush=True)
    subprocess.run(["apt-get", "update", "-qq"], check=True)
    subprocess.run(["apt-get", "install", "-y", "-qq", "wrk"], check=True)
    return shutil.which("wrk") or "wrk"


def wait_http(url: str, accept: Callable[[str], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if accept(resp.read().decode(errors="replace")):
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{url} did not become ready within {timeout:.0f}s")


_UNITS = {"us": 0.001, "ms": 1.0, "s": 1000.0}


def _ms(text: str) -> float:
    match = re.match(r"([\d.]+)(us|ms|s)", text)
    if not match:
        return float("nan")
    return float(match.group(1)) * _UNITS[match.group(2)]


@dataclass
class WrkResult:
    requests: int
    rps: float
    p50_ms: float
    p99_ms: float
    errors: int


def run_wrk(
    wrk: str, url: str, body: dict[str, object], conns: int, seconds: int, script_dir: Path
) -> WrkResult:
    script = script_dir / "post.lua"
    script.write_text(
        'wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
        f"wrk.body = {json.dumps(json.dumps(body))}\n"
    )
    out = subprocess.run(
        [wrk, "-t1", f"-c{conns}", f"-d{seconds}s", "--latency", "-s", str(script), url],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return parse_wrk(out)


def parse_wrk(out: str) -> WrkResult:
    """The figures of one wrk run (`--latency`) from what it printed."""
    requests = int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    # Anchor at line start: "68.50%" in the stdev column must not read as the 50th percentile.
    p50 = _ms(re.search(r"^\s+50%\s+(\S+)", out, re.M).group(1))  # type: ignore[union-attr]
    p99 = _ms(re.search(r"^\s+99%\s+(\S+)", out, re.M).group(1))  # type: ignore[union-attr]
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    errors = int(bad.group(1)) if bad else 0
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    if sock:
        errors += sum(int(x) for x in sock.groups())
    return WrkResult(requests, rps, p50, p99, errors)


class Fleet:
    """Named processes with logs in one folder; `stop` ends them all."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, args: list[str], env: dict[str, str] | None = None) -> None:
        log = (self.tmp / f"{name}.log").open("wb")
        full_env = {
            **os.environ,
            "HIVENET_ROUTER_ADMIN_API_KEYS": secrets.token_urlsafe(16),
            # A router keeps audit records by default; in a benchmark, in its scratch folder.
            "HIVENET_ROUTER_AUDIT_LOG_PATH": str(self.tmp / f"{name}-audit.jsonl"),
            **(env or {}),
        }
        self.procs[name] = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, env=full_env, cwd=self.tmp
        )

    def pid(self, name: str) -> int:
        return self.procs[name].pid

    def stop(self, names: list[str] | None = None) -> None:
        """Stop these processes (and their children), or all of them when `names` is None."""
        chosen = [self.procs.pop(n) for n in (list(self.procs) if names is None else names)]
        for proc in chosen:
            for child in _tree(proc.pid)[1:]:
                child.terminate()
            proc.terminate()
        for proc in chosen:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)


def secret_file(tmp: Path) -> Path:
    secret = tmp / "jwt.secret"
    secret.write_text(secrets.token_urlsafe(48))
    secret.chmod(0o600)
    return secret


def router_args(secret: Path, store: Path, http: int, grpc: int, *extra: str) -> list[str]:
    p2p, met = free_port(), free_port()
    return [
        str(BIN / "hivenet-router"),
        "--http-port",
        f"127.0.0.1:{http}",
        "--grpc-port",
        f"127.0.0.1:{grpc}",
        "--metrics-port",
        f"127.0.0.1:{met}",
        "--p2p-port",
        str(p2p),
        "--jwt-secret-file",
        str(secret),
        "--log-level",
        "warn",
        "--disk-db-path",
        str(store),
        *extra,
    ]


def agent_args(secret: Path, grpc: int, backend: str, identity: Path, *extra: str) -> list[str]:
    return [
        str(BIN / "hivenet-agent"),
        "--backend-url",
        backend,
        "--router-grpc",
        f"127.0.0.1:{grpc}",
        "--jwt-secret-file",
        str(secret),
        "--identity-path",
        str(identity),
        "--reconnect-delay",
        "200ms",
        "--log-level",
        "warn",
        *extra,
    ]


def venv(name: str, requirements: list[str]) -> Path:
    """A virtualenv of its own for one peer, made once per requirement set, in the cache."""
    key = "-".join(r.replace("[", "_").replace("]", "").replace("==", "-") for r in requirements)
    folder = CACHE / "peers" / key
    marker = folder / ".ready"
    if marker.exists():
        return folder / "bin"
    print(f"installing {' '.join(requirements)} into {folder} ...", flush=True)
    shutil.rmtree(folder, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(folder)], check=True)
    pip = [str(folder / "bin" / "pip"), "install", "--quiet", "--disable-pip-version-check"]
    subprocess.run([*pip, *requirements], check=True)
    marker.touch()
    return folder / "bin"


def replace_section(marker: str, content: str) -> None:
    """Put `content` between <!-- bench:MARKER --> and its closing marker in the docs page."""
    text = DOC.read_text()
    start, end = f"<!-- bench:{marker} -->", f"<!-- /bench:{marker} -->"
    if start not in text:
        text = f"{text.rstrip()}\n\n{start}\n{end}\n"
    head, _, rest = text.partition(start)
    _, _, tail = rest.partition(end)
    DOC.write_text(f"{head}{start}\n{content}\n{end}{tail}")


def publish(name: str, data: object, text: str, docs: bool) -> None:
    """Write bench/results/NAME.json, print the report, and put it in the docs page."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(data, indent=2))
    print(text)
    if docs:
        replace_section(name, text)
