"""The response cache keeps only answers that parse as the route's success, through real
processes: a stand-in engine behind an agent answers 200 with an HTML page, or an in-band
error whose key is written with a JSON escape (`{"\\u0065rror": ...}`), whole or streamed;
none of them is stored, and a good answer is."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx2 as httpx
import orjson
import pytest

from tests.procs import Cluster, Router, metric, wait_until

MODEL = "m"
GOOD = orjson.dumps(
    {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": MODEL,
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}
        ],
        "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
    }
)
ANSWERS: dict[str, tuple[str, bytes]] = {
    "html": ("text/html", b"<html><body>502 Bad Gateway</body></html>"),
    "escaped": ("application/json", b'{"\\u0065rror": {"message": "overloaded"}}'),
    "escaped-stream": (
        "text/event-stream",
        b'data: {"\\u0065rror": {"message": "out of memory"}}\n\ndata: [DONE]\n\n',
    ),
    "good": ("application/json", GOOD),
}


class Engine:
    """An engine that answers every chat completion 200 with `ANSWERS[self.mode]`."""

    def __init__(self) -> None:
        self.mode = "good"
        self.calls = 0
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self._send(200, "text/plain", b"ok" if self.path == "/health" else b"")

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                engine.calls += 1
                self._send(200, *ANSWERS[engine.mode])

            def _send(self, status: int, kind: str, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"


@pytest.fixture
def engine() -> Iterator[Engine]:
    standin = Engine()
    thread = threading.Thread(target=standin.server.serve_forever, daemon=True)
    thread.start()
    try:
        yield standin
    finally:
        standin.server.shutdown()
        standin.server.server_close()


def post(router: Router, stream: bool) -> httpx.Response:
    body = {
        "model": MODEL,
        "stream": stream,
        "temperature": 0,
        "messages": [{"role": "user", "content": "same"}],
    }
    return httpx.post(router.url + "/v1/chat/completions", json=body, timeout=20)


def test_only_the_routes_success_is_stored(
    make_cluster: Cluster, tmp_path: Path, engine: Engine
) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text("response_cache: {}\nrouting_policy: {strategy: least-loaded}\n")
    router = make_cluster.router("--policy-file", str(policy))
    make_cluster.agent(
        router,
        None,
        *("--engine", "custom", "--model", MODEL, "--health-url", engine.url + "/health"),
        backend_url=engine.url,
    )
    wait_until(lambda: metric(router.metrics(), "hivenet_routing_agent_healthy") == 1.0)
    for mode in ("html", "escaped", "escaped-stream"):
        engine.mode, before = mode, engine.calls
        for _ in range(2):
            reply = post(router, stream=mode.endswith("stream"))
            assert reply.status_code == 200 and reply.headers.get("x-hivenet-cache") == "miss"
        assert engine.calls == before + 2, f"{mode} was stored"
    engine.mode, before = "good", engine.calls
    replies = [post(router, stream=False) for _ in range(2)]
    assert [reply.headers.get("x-hivenet-cache") for reply in replies] == ["miss", "hit"]
    assert engine.calls == before + 1 and replies[1].content == GOOD
