"""A stdio MCP server with one tool, `search`, for Codex CLI in the tests: each call is
written to the file named by its first argument, so a test can see that Codex ran it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

CALLS = Path(sys.argv[1])
TOOL = {
    "name": "search",
    "description": "Search the documentation.",
    "inputSchema": {"type": "object", "properties": {"query": {"type": "string"}}},
}


def answer(message: dict[str, object]) -> dict[str, object] | None:
    method = message.get("method")
    if method == "initialize":
        params = message.get("params")
        version = params.get("protocolVersion") if isinstance(params, dict) else None
        return {
            "protocolVersion": version or "2025-06-18",
            "capabilities": {"tools": {}},
            "serverInfo": {"name": "docs", "version": "1"},
        }
    if method == "tools/list":
        return {"tools": [TOOL]}
    if method == "tools/call":
        with CALLS.open("a") as calls:
            calls.write(json.dumps(message.get("params")) + "\n")
        return {"content": [{"type": "text", "text": "found: tides come from the moon"}]}
    if method == "ping":
        return {}
    return None


for line in sys.stdin:
    if not line.strip():
        continue
    message = json.loads(line)
    if "id" not in message:
        continue  # a notification
    result = answer(message)
    reply: dict[str, object] = {"jsonrpc": "2.0", "id": message["id"]}
    if result is None:
        reply["error"] = {"code": -32601, "message": f"no method {message.get('method')}"}
    else:
        reply["result"] = result
    sys.stdout.write(json.dumps(reply) + "\n")
    sys.stdout.flush()
