"""Memory per stream in flight: the router's resident set with N streams held open.

    python -m bench.stream_memory                          # 250, 500, 750, 1000 streams
    python -m bench.stream_memory --prompt-bytes 80000     # agentic-size prompts

One simulator at one token a second (streams last as long as the client keeps them), one
agent of capacity 1000 and a router with a forwarding limit above that. Streams are opened
in steps and held; after each step the router's and the agent's RSS is read. The slope
between the first and the last step is the memory one more stream costs (allocator growth
included: it is what an operator sizes for); the request body is part of it, since the
router keeps it for retries until the answer ends. docs/api.md quotes the result.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

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
from bench.soak import rss_mb

ENGINE = (
    "--itl", "1s", "--batch-slowdown", "0", "--ttft-base", "0", "--max-num-seqs", "4096",
    "--kv-cache-tokens", "100000000", "--max-model-len", "262144",
)  # fmt: skip


async def hold(port: int, body: bytes, opened: asyncio.Event, release: asyncio.Event) -> None:
    """One streamed request on its own connection, read until the test lets go."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    head = await reader.readuntil(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(head.decode(errors="replace"))
    opened.set()
    reading = asyncio.ensure_future(reader.read(1 << 20))
    while not release.is_set():
        done, _ = await asyncio.wait({reading, asyncio.ensure_future(release.wait())}, timeout=5)
        if reading in done:
            reading = asyncio.ensure_future(reader.read(1 << 20))
    reading.cancel()
    writer.close()


async def measure(port: int, fleet: Fleet, steps: list[int], prompt_bytes: int) -> list[dict]:
    content = ("lorem ipsum " * (prompt_bytes // 12 + 1))[:prompt_bytes]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": content}]}
    body = json.dumps({**chat, "max_tokens": 100000, "stream": True}).encode()
    release = asyncio.Event()
    tasks: list[asyncio.Task[None]] = []
    rows = []
    try:
        for total in steps:
            events = []
            while len(tasks) < total:
                opened = asyncio.Event()
                events.append(opened)
                tasks.append(asyncio.create_task(hold(port, body, opened, release)))
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 300)
            await asyncio.sleep(2)  # let the last heads and first chunks settle
            rows.append(
                {
                    "streams": total,
                    "router_mib": round(rss_mb(fleet.pid("router")), 1),
                    "agent_mib": round(rss_mb(fleet.pid("agent")), 1),
                }
            )
            print(rows[-1], flush=True)
    finally:
        release.set()
        await asyncio.gather(*tasks, return_exceptions=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", default="0,250,500,750,1000")
    parser.add_argument("--prompt-bytes", type=int, default=100)
    args = parser.parse_args()
    steps = [int(n) for n in args.steps.split(",")]
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        fleet = Fleet(tmp)
        try:
            engine = free_port()
            fleet.start(
                "sim", [str(BIN / "hivenet-sim"), "--port", str(engine), "--model", MODEL, *ENGINE]
            )
            secret = secret_file(tmp)
            http, grpc = free_port(), free_port()
            limit = str(max(steps) + 10)
            fleet.start(
                "router",
                router_args(
                    secret,
                    tmp / "store",
                    http,
                    grpc,
                    "--max-concurrent",
                    limit,
                    "--request-timeout",
                    "1h",
                    "--warmup",
                    "0s",
                ),
            )
            identity = tmp / "agent.key"
            backend = f"http://127.0.0.1:{engine}"
            fleet.start(
                "agent", agent_args(secret, grpc, backend, identity, "--capacity", str(max(steps)))
            )
            wait_http(f"http://127.0.0.1:{http}/v1/models", lambda t: '"healthy_replicas":1' in t)
            started = time.monotonic()
            rows = asyncio.run(measure(http, fleet, steps, args.prompt_bytes))
        finally:
            fleet.stop()
    first, last = rows[0], rows[-1]
    count = last["streams"] - first["streams"]
    for name in ("router", "agent"):
        slope = (last[f"{name}_mib"] - first[f"{name}_mib"]) * 1024 / count
        print(f"{name}: {slope:.1f} KiB per stream in flight ({args.prompt_bytes}-byte prompts)")
    print(f"{time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
