"""What the stream validator's held window adds to the time to first token.

    python -m bench.validator
    python -m bench.validator --requests 50 --itl 15ms --hold-chunks 15

One router, two simulators with the same token delay, each behind its own agent. Model
`checked` has a policy with `stream_validator` (hold_chunks as given), and model `plain` has
none. The same streamed chat requests go to each, one at a time and alternating. For each
request, the time to the first byte of content is measured from the client's side. The
table shows p50 and p90 over N requests, and the difference.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import httpx2 as httpx

from bench.common import (
    BIN,
    Fleet,
    agent_args,
    free_port,
    router_args,
    secret_file,
    wait_http,
)

POLICY = """\
models: [{model}]
routing_policy:
  strategy: least-loaded
{block}
"""


def _policies(tmp: Path, hold_chunks: int) -> Path:
    folder = tmp / "policies"
    folder.mkdir()
    block = f"stream_validator: {{hold_chunks: {hold_chunks}}}"
    (folder / "checked.yaml").write_text(POLICY.format(model="checked", block=block))
    (folder / "plain.yaml").write_text(POLICY.format(model="plain", block=""))
    return folder


def _start(fleet: Fleet, tmp: Path, itl: str, hold_chunks: int) -> str:
    secret = secret_file(tmp)
    http, grpc = free_port(), free_port()
    policies = _policies(tmp, hold_chunks)
    args = router_args(secret, tmp / "store", http, grpc, "--policy-model-dir", str(policies))
    fleet.start("router", args)
    url = f"http://127.0.0.1:{http}"
    wait_http(url + "/health", lambda body: "ok" in body)
    for model in ("checked", "plain"):
        port = free_port()
        sim = [str(BIN / "hivenet-sim"), "--port", str(port), "--model", model]
        fleet.start(f"sim-{model}", [*sim, "--itl", itl, "--ttft-base", "20ms"])
        wait_http(f"http://127.0.0.1:{port}/health", lambda body: True)
        backend = f"http://127.0.0.1:{port}"
        identity = tmp / f"agent-{model}.key"
        fleet.start(f"agent-{model}", agent_args(secret, grpc, backend, identity))
    wait_http(url + "/v1/models", lambda body: "checked" in body and "plain" in body)
    return url


def _ttft(client: httpx.Client, url: str, model: str, index: int) -> float:
    """Seconds from sending the request to the first chunk that carries content."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"request {index}"}],
        "max_tokens": 48,
        "stream": True,
    }
    started = time.perf_counter()
    first = 0.0
    with client.stream("POST", url + "/v1/chat/completions", json=body) as reply:
        for chunk in reply.iter_bytes():
            if not first and b'"content":"' in chunk and b'"content":""' not in chunk:
                first = time.perf_counter() - started
    return first


def _row(name: str, values: list[float]) -> tuple[str, float, float]:
    ordered = sorted(values)
    p90 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.9))]
    return name, statistics.median(ordered) * 1000, p90 * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--itl", default="15ms", help="the simulators' time per token")
    parser.add_argument("--hold-chunks", type=int, default=15)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        tmp = Path(scratch)
        fleet = Fleet(tmp)
        try:
            url = _start(fleet, tmp, args.itl, args.hold_chunks)
            times: dict[str, list[float]] = {"plain": [], "checked": []}
            with httpx.Client(timeout=30) as client:
                for index in range(args.requests):
                    for model in ("plain", "checked"):
                        times[model].append(_ttft(client, url, model, index))
        finally:
            fleet.stop()
    rows = [_row("validator off", times["plain"]), _row("validator on", times["checked"])]
    print(f"TTFT, {args.requests} requests each, itl {args.itl}, hold_chunks {args.hold_chunks}")
    print(f"{'':16}{'p50 ms':>10}{'p90 ms':>10}")
    for name, p50, p90 in rows:
        print(f"{name:16}{p50:10.1f}{p90:10.1f}")
    added = rows[1][1] - rows[0][1], rows[1][2] - rows[0][2]
    print(f"{'added':16}{added[0]:10.1f}{added[1]:10.1f}")


if __name__ == "__main__":
    main()
