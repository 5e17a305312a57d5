"""`make run`: a router, one agent and one engine simulator on loopback, in the foreground.

Ctrl-C stops all three. State (the shared secret, the agent identity) lives in .run/, or
in HIVENET_RUN_STATE. The ports are the router's defaults, each one's own variable moves
it (a second `make run` on a shared machine): HIVENET_RUN_HTTP_PORT (8080),
HIVENET_RUN_ENGINE_PORT (8888), HIVENET_RUN_GRPC_PORT (50051), HIVENET_RUN_METRICS_PORT
(2112), HIVENET_RUN_P2P_PORT (9000).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STATE = Path(os.environ.get("HIVENET_RUN_STATE", ROOT / ".run"))
BIN = Path(sys.executable).parent
HTTP = os.environ.get("HIVENET_RUN_HTTP_PORT", "8080")
MODEL = os.environ.get("HIVENET_RUN_MODEL", "sim-model")
ENGINE_PORT = int(os.environ.get("HIVENET_RUN_ENGINE_PORT", "8888"))
GRPC = os.environ.get("HIVENET_RUN_GRPC_PORT", "50051")
METRICS = os.environ.get("HIVENET_RUN_METRICS_PORT", "2112")
P2P = os.environ.get("HIVENET_RUN_P2P_PORT", "9000")
# The engine as agentic clients need it: Claude Code, Codex CLI and opencode send about
# 19,000 tokens of tools and system prompt and ask for up to 32,000 output tokens, which
# the simulator's default 8,192-token context refuses (400 context_length_exceeded). A
# 256k context with room in the KV cache for several such requests at once, and answers
# that stop by themselves after 256 tokens (finish_reason "stop", about 4 s at the
# simulator's pace) rather than run to 32,000. tests/integration/test_run_local.py
# sends such a request to an engine started with these settings.
ENGINE_OPTIONS = (
    "--max-model-len",
    "262144",
    "--kv-cache-tokens",
    "1000000",
    "--answer-cap",
    "256",
)


def engine_command(port: int = ENGINE_PORT, model: str = MODEL) -> list[str]:
    """The simulator `make run` starts."""
    return [
        str(BIN / "hivenet-sim"),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--model",
        model,
        *ENGINE_OPTIONS,
    ]


def _secret() -> Path:
    STATE.mkdir(parents=True, exist_ok=True)
    path = STATE / "jwt.secret"
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(secrets.token_urlsafe(48) + "\n")
    return path


def _admin_key() -> str:
    path = STATE / "admin.key"
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(secrets.token_urlsafe(24))
    return path.read_text().strip()


def _wait_for_model(
    url: str, admin: str, children: dict[str, subprocess.Popen[bytes]], deadline: float
) -> str | None:
    """None once the router lists the model; else why not: a process that exited (named,
    at once, rather than after the whole wait), or the time spent. The admin catalog is
    read with the admin key, so that keys required of clients (HIVENET_ROUTER_AUTH_CONFIG)
    do not stand in the way."""
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {admin}"})  # noqa: S310
    while time.monotonic() < deadline:
        for name, child in children.items():
            if child.poll() is not None:
                return f"the {name} exited (status {child.returncode}); see its log above"
        try:
            with urllib.request.urlopen(request, timeout=1) as resp:  # noqa: S310 (loopback)
                ids = [m["id"] for m in json.load(resp)["data"]]
                if MODEL in ids:
                    return None
        except (urllib.error.URLError, OSError, ValueError, KeyError):
            pass
        time.sleep(0.2)
    return "the router did not list the model within 30s; see the logs above"


def main() -> int:
    secret = _secret()
    commands = [
        engine_command(),
        [
            str(BIN / "hivenet-router"),
            "--http-port",
            f"127.0.0.1:{HTTP}",
            "--grpc-port",
            f"127.0.0.1:{GRPC}",
            "--metrics-port",
            f"127.0.0.1:{METRICS}",
            "--p2p-port",
            P2P,
            "--jwt-secret-file",
            str(secret),
            "--disk-db-path",
            str(STATE / "store"),
            "--audit-log-path",
            str(STATE / "audit.jsonl"),
        ],
        [
            str(BIN / "hivenet-agent"),
            "--engine",
            "vllm",
            "--backend-url",
            f"http://127.0.0.1:{ENGINE_PORT}",
            "--router-grpc",
            f"127.0.0.1:{GRPC}",
            "--jwt-secret-file",
            str(secret),
            "--identity-path",
            str(STATE / "agent_identity.key"),
            "--reconnect-delay",
            "500ms",
        ],
    ]
    admin = _admin_key()
    env = {**os.environ, "HIVENET_ROUTER_ADMIN_API_KEYS": admin}
    named = {
        name: subprocess.Popen(command, env=env)
        for name, command in zip(("engine", "router", "agent"), commands, strict=True)
    }
    children = list(named.values())

    def stop(*_: object) -> None:
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    base = f"http://127.0.0.1:{HTTP}"
    failed = _wait_for_model(f"{base}/admin/models", admin, named, time.monotonic() + 30)
    if failed is None:
        body = json.dumps(
            {"model": MODEL, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 16}
        )
        print(
            f"\nHivenet Router is ready at {base} (model {MODEL}). Try:\n\n"
            f"  curl {base}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
            f"    -d '{body}'\n\n"
            f"Admin:   curl -H 'Authorization: Bearer {admin}' {base}/admin/health\n"
            f"Metrics: http://127.0.0.1:{METRICS}/metrics   "
            f"Audit records: {STATE / 'audit.jsonl'}\n"
            "Stop: Ctrl-C\n",
            flush=True,
        )
    else:
        print(failed, flush=True)
    while all(child.poll() is None for child in children):
        time.sleep(0.2)
    stop()
    for child in children:
        try:
            child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            child.kill()
    return 0 if failed is None else 1


if __name__ == "__main__":
    sys.exit(main())
