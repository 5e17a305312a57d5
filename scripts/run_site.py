"""`make run-site`: one site of three routers that share a Valkey store, on loopback.

Starts a Valkey primary, two replicas and three Sentinels, two engine simulators, three
routers (--sync-store valkey, through the Sentinels) and two agents that connect to every
router, then prints where everything is and runs in the foreground until Ctrl-C, which
stops it all. Logs and state go to a temporary folder, removed at the end unless something
failed; set HIVENET_SITE_DIR to keep them in a folder of your choice.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.valkey_site import ValkeySite, free_port, terminate  # noqa: E402 (needs the repo root)

BIN = Path(sys.executable).parent
MODEL = os.environ.get("HIVENET_RUN_MODEL", "sim-model")
SITE = "local"
ROUTERS = 3
AGENTS = 2
READY_TIMEOUT = 60.0


@dataclass
class Child:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def stop(self, timeout: float = 10.0) -> None:
        terminate(self.popen, timeout)


@dataclass
class RouterPorts:
    name: str
    http: int
    grpc: int
    metrics: int
    p2p: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http}"

    @property
    def grpc_addr(self) -> str:
        return f"127.0.0.1:{self.grpc}"


class Site:
    """The processes of the site; `close` stops them, agents first, the store last."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.children: list[Child] = []
        self.valkey = ValkeySite(directory / "valkey")
        self.admin_key = secrets.token_urlsafe(24)
        self.secret = directory / "jwt.secret"
        fd = os.open(self.secret, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(secrets.token_urlsafe(48) + "\n")

    def spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> Child:
        log = self.directory / f"{name}.log"
        with log.open("ab") as handle:
            popen = subprocess.Popen(
                [str(BIN / args[0]), *args[1:]],
                stdout=handle,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            )
        child = Child(name, popen, log)
        self.children.append(child)
        return child

    def close(self) -> None:
        for child in reversed(self.children):
            child.stop()
        self.valkey.stop()

    def failed(self) -> str:
        """The logs of the processes that exited, for the message of a failed start."""
        dead = [c for c in self.children if not c.alive]
        return "\n".join(
            f"===== {c.name} (exit {c.popen.returncode}) =====\n{c.tail()}" for c in dead
        )


def distinct_ports(count: int) -> list[int]:
    ports: list[int] = []
    for _ in range(count * 20):
        port = free_port()
        if port not in ports:
            ports.append(port)
        if len(ports) == count:
            return ports
    raise RuntimeError(f"could not find {count} distinct free ports")


def get_json(url: str) -> object:
    with urllib.request.urlopen(url, timeout=1) as resp:  # noqa: S310 (loopback http)
        return json.load(resp)


def healthy_replicas(router: RouterPorts) -> int:
    data = get_json(f"{router.url}/v1/models")
    models = data.get("data", []) if isinstance(data, dict) else []
    return sum(int(m.get("healthy_replicas", 0)) for m in models if m.get("id") == MODEL)


def wait_for(
    what: str, check: Callable[[], bool], site: Site, timeout: float = READY_TIMEOUT
) -> None:
    """Poll `check` until it returns True; give up after `timeout` or when a process died."""
    last: object = None
    deadline = time.monotonic() + timeout
    for _ in range(int(timeout / 0.2) + 1):
        if any(not c.alive for c in site.children):
            raise RuntimeError(f"a process exited while waiting for {what}:\n{site.failed()}")
        try:
            last = check()
            if last is True:
                return
        except (urllib.error.URLError, OSError, ValueError, KeyError) as error:
            last = error
        if time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")


def start(site: Site) -> list[RouterPorts]:
    """Start everything in order, each part once the one it needs answers."""
    site.valkey.start()
    ports = distinct_ports(AGENTS + 4 * ROUTERS)
    sims = ports[:AGENTS]
    for index, port in enumerate(sims, start=1):
        args = ["hivenet-sim", "--host", "127.0.0.1", "--port", str(port), "--model", MODEL]
        site.spawn(f"sim-{index}", args)
    routers = start_routers(site, ports[AGENTS:])
    for router in routers:
        wait_for(f"{router.name} /health", functools.partial(_health, router), site)
    start_agents(site, sims, routers)
    for router in routers:
        wait_for(f"both agents on {router.name}", functools.partial(_registered, router), site)
    return routers


def start_routers(site: Site, ports: list[int]) -> list[RouterPorts]:
    """The routers of the site, sharing the store through the Sentinels; four ports each."""
    sentinels = ",".join(site.valkey.sentinel_addrs)
    routers: list[RouterPorts] = []
    for index in range(1, ROUTERS + 1):
        http, grpc, met, p2p = ports[4 * (index - 1) : 4 * index]
        router = RouterPorts(f"router-{index}", http, grpc, met, p2p)
        routers.append(router)
        state = site.directory / router.name
        state.mkdir(exist_ok=True)
        listen = [
            f"--http-port=127.0.0.1:{http}",
            f"--grpc-port={router.grpc_addr}",
            f"--metrics-port=127.0.0.1:{met}",
            f"--p2p-port={p2p}",
        ]
        sync = [
            "--sync-store=valkey",
            f"--sync-sentinels={sentinels}",
            f"--sync-master={site.valkey.master_name}",
            f"--sync-site={SITE}",
            f"--router-id={router.name}",
            f"--advertise-grpc-addr={router.grpc_addr}",
            f"--sync-min-routers={ROUTERS}",
        ]
        files = [
            f"--jwt-secret-file={site.secret}",
            f"--disk-db-path={state / 'store'}",
            f"--audit-log-path={state / 'audit.jsonl'}",
        ]
        site.spawn(
            router.name,
            ["hivenet-router", *listen, *sync, *files],
            {"HIVENET_ROUTER_ADMIN_API_KEYS": site.admin_key},
        )
    return routers


def start_agents(site: Site, sims: list[int], routers: list[RouterPorts]) -> None:
    """One agent per simulator, each with a session to every router."""
    every = ",".join(r.grpc_addr for r in routers)
    for index, port in enumerate(sims, start=1):
        site.spawn(
            f"agent-{index}",
            [
                "hivenet-agent",
                "--engine=vllm",
                f"--backend-url=http://127.0.0.1:{port}",
                f"--routers={every}",
                f"--jwt-secret-file={site.secret}",
                f"--identity-path={site.directory / f'agent-{index}.key'}",
                "--reconnect-delay=500ms",
            ],
        )


def _registered(router: RouterPorts) -> bool:
    return healthy_replicas(router) >= AGENTS


def _health(router: RouterPorts) -> bool:
    with urllib.request.urlopen(f"{router.url}/health", timeout=1) as resp:  # noqa: S310
        return bool(resp.status == 200)


def describe(site: Site, routers: list[RouterPorts]) -> str:
    lines = [f"\nHivenet site {SITE!r} is ready: model {MODEL} on {AGENTS} agents.\n"]
    for router in routers:
        lines.append(
            f"  {router.name}  client {router.url}  "
            f"metrics http://127.0.0.1:{router.metrics}/metrics  agents {router.grpc_addr}"
        )
    body = json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 16}
    )
    lines += [
        "",
        f"Sentinels (master {site.valkey.master_name}): {', '.join(site.valkey.sentinel_addrs)}",
        f"Valkey primary now: {site.valkey.primary_addr}",
        "",
        f"Try: curl {routers[0].url}/v1/chat/completions -H 'Content-Type: application/json' \\",
        f"       -d '{body}'",
        f"Admin: curl -H 'Authorization: Bearer {site.admin_key}' {routers[0].url}/admin/health",
        f"Logs and state: {site.directory}",
        "Stop: Ctrl-C\n",
    ]
    return "\n".join(lines)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--duration", type=float, default=0.0, help="stop after this many seconds (0: Ctrl-C)"
    )
    options = parser.parse_args()
    keep = os.environ.get("HIVENET_SITE_DIR", "")
    directory = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="hivenet-site-"))
    directory.mkdir(parents=True, exist_ok=True)
    # Set both: a shell that starts this in the background makes it ignore SIGINT.
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    site = Site(directory)
    status = 0
    try:
        routers = start(site)
        print(describe(site, routers), flush=True)
        until = time.monotonic() + options.duration if options.duration > 0 else float("inf")
        while time.monotonic() < until:
            dead = [c for c in site.children if not c.alive]
            if dead:
                print(f"stopping: a process exited\n{site.failed()}", flush=True)
                status = 1
                break
            time.sleep(0.5)
    except KeyboardInterrupt:
        print("\nstopping the site ...", flush=True)
    except Exception as error:
        print(f"the site failed: {error}", flush=True)
        status = 1
    finally:
        # A second Ctrl-C must not leave processes behind half-way through stopping them.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        site.close()
        if status:
            print(f"logs kept in {directory}", flush=True)
        elif not keep:
            shutil.rmtree(directory, ignore_errors=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
