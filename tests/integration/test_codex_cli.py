"""Codex CLI itself, headless (`codex exec`), against the router over the Responses API.

Codex speaks only `/v1/responses` (streamed, `store: false`, its tools, reasoning with
`include: ["reasoning.encrypted_content"]`). Until the router serves that route, the
end-to-end test skips; the configuration it uses is checked now against a stand-in server
that answers with the fewest Responses events Codex accepts.
"""

from __future__ import annotations

import hashlib
import json
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx2 as httpx
import pytest

from tests.codex import codex_cli, run_codex
from tests.procs import Cluster, metric, wait_until

MODEL = "hivenet-router-codex-model"
KEY = "sk-hivenet-codex"


def test_codex_gets_an_answer_through_the_router(make_cluster: Cluster, tmp_path: Path) -> None:
    program = codex_cli()
    auth = tmp_path / "auth.yaml"
    auth.write_text(
        "api:\n  mode: api-key\n  keys:\n"
        f'    - key_hash: "{hashlib.sha256(KEY.encode()).hexdigest()}"\n'
        "      metadata: {name: codex, owner: codex}\n"
    )
    router = make_cluster.router("--auth-config-file", str(auth))
    sim = make_cluster.sim(
        MODEL,
        "--zero-latency",
        "--max-model-len",
        "262144",
        "--kv-cache-tokens",
        "1000000",
        "--answer-cap",
        "24",
    )
    make_cluster.agent(router, sim)
    wait_until(lambda: metric(router.metrics(), "hivenet_routing_agent_healthy") == 1.0)
    probe = httpx.post(
        router.url + "/v1/responses",
        json={"model": MODEL, "input": "hi", "max_output_tokens": 4},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=30,
    )
    if probe.status_code == 404:
        pytest.skip("needs /v1/responses")
    run = run_codex(program, tmp_path / "home", router.url, MODEL, KEY, "Say hello.")
    assert run.returncode == 0 and not run.failed(), (run.events, run.stderr[-2000:])
    assert run.messages() and run.last_message.strip()  # the simulator's words, relayed
    assert any(e.get("type") == "turn.completed" for e in run.events)
    # A turn that calls a tool: the simulator calls Codex's shell tool when the prompt says
    # so (sim/tools.py); Codex runs it, sends its output back, and gets a text answer.
    tool_turn = run_codex(
        program, tmp_path / "home2", router.url, MODEL, KEY, "List files. [call:exec_command]"
    )
    assert tool_turn.returncode == 0 and not tool_turn.failed(), tool_turn.events
    commands = [
        e for e in tool_turn.events
        if e.get("type") == "item.completed" and e["item"].get("type") == "command_execution"
    ]  # fmt: skip
    assert commands, tool_turn.events
    assert tool_turn.last_message.strip()
    assert any(e.get("type") == "turn.completed" for e in tool_turn.events)
    # An MCP server's tool: Codex sends it in a namespace and runs a call of it only by
    # that namespace, which the router gives back (it did not: "unsupported call").
    calls = tmp_path / "mcp-calls.jsonl"
    server = Path(__file__).resolve().parent.parent / "data" / "mcp_search.py"
    mcp = (
        "\n[mcp_servers.docs]\n"
        f"command = {json.dumps(sys.executable)}\n"
        f"args = [{json.dumps(str(server))}, {json.dumps(str(calls))}]\n"
        'default_tools_approval_mode = "approve"\n'  # exec asks nobody: run it
    )
    mcp_turn = run_codex(
        program, tmp_path / "home3", router.url, MODEL, KEY, "Search the docs. [call:search]", mcp
    )
    assert mcp_turn.returncode == 0 and not mcp_turn.failed(), mcp_turn.events
    assert calls.exists(), (mcp_turn.events, mcp_turn.stderr[-2000:])
    assert "unsupported call" not in mcp_turn.stderr
    ran = [
        e["item"] for e in mcp_turn.events
        if e.get("type") == "item.completed" and e["item"].get("type") == "mcp_tool_call"
    ]  # fmt: skip
    assert [(i["server"], i["tool"], i["status"]) for i in ran] == [("docs", "search", "completed")]
    text = router.metrics()
    assert (metric(text, "hivenet_tenant_requests_success_total", tenant_id="codex") or 0) >= 5
    assert metric(text, "hivenet_tenant_requests_failed_total", tenant_id="codex") is None


# -- the configuration, against a stand-in ----------------------------------------------------

ANSWER = "hello from the stand-in"


def _events(model: str) -> list[dict[str, Any]]:
    """The fewest Responses stream events `codex exec` takes for a whole answer."""
    item = {"id": "msg_1", "type": "message", "role": "assistant"}
    part = {"type": "output_text", "text": ANSWER, "annotations": []}
    usage = {
        "input_tokens": 10,
        "output_tokens": 4,
        "total_tokens": 14,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens_details": {"reasoning_tokens": 0},
    }
    response = {"id": "resp_1", "object": "response", "model": model, "output": []}
    at = {"item_id": "msg_1", "output_index": 0, "content_index": 0}
    return [
        {"type": "response.created", "response": {**response, "status": "in_progress"}},
        {
            "type": "response.output_item.added",
            "output_index": 0,
            "item": {**item, "status": "in_progress", "content": []},
        },
        {"type": "response.content_part.added", **at, "part": {**part, "text": ""}},
        {"type": "response.output_text.delta", **at, "delta": ANSWER},
        {"type": "response.output_text.done", **at, "text": ANSWER},
        {
            "type": "response.output_item.done",
            "output_index": 0,
            "item": {**item, "status": "completed", "content": [part]},
        },
        {
            "type": "response.completed",
            "response": {**response, "status": "completed", "usage": usage},
        },
    ]


class _StandIn(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    seen: list[tuple[str, dict[str, str], dict[str, Any]]]

    def do_POST(self) -> None:
        size = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(size) or b"{}")
        self.seen.append((self.path, dict(self.headers), body))
        stream = b"".join(
            f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode()
            for e in _events(str(body.get("model")))
        )
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Content-Length", str(len(stream)))
        self.end_headers()
        self.wfile.write(stream)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def stand_in() -> Iterator[tuple[str, list[tuple[str, dict[str, str], dict[str, Any]]]]]:
    seen: list[tuple[str, dict[str, str], dict[str, Any]]] = []
    handler = type("Handler", (_StandIn,), {"seen": seen})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_the_configuration_points_codex_at_a_responses_server(
    stand_in: tuple[str, list[tuple[str, dict[str, str], dict[str, Any]]]], tmp_path: Path
) -> None:
    program = codex_cli()
    url, seen = stand_in
    run = run_codex(program, tmp_path / "home", url, MODEL, KEY, "Say hello.")
    assert run.returncode == 0 and not run.failed(), (run.events, run.stderr[-2000:])
    assert run.messages() == [ANSWER] and run.last_message.strip() == ANSWER
    path, headers, body = seen[0]
    assert path == "/v1/responses"
    assert {k.lower(): v for k, v in headers.items()}["authorization"] == f"Bearer {KEY}"
    assert body["model"] == MODEL and body["stream"] is True and body["store"] is False
