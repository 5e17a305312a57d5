"""Claude Code itself, headless, against the router: the reference's first integration.

Its requests carry everything a real agentic client sends (a system prompt as blocks with
cache_control, dozens of tool schemas, thinking, metadata, beta headers), streamed. The
simulator answers in text; Claude Code must print that answer and report no error.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.procs import Cluster, metric, wait_until
from tests.real.engines import printed_paths

MODEL = "hivenet-router-code-model"
KEY = "sk-hivenet-claude-code"


def claude_code() -> Path:
    path = Path(printed_paths("claude_code.sh")["CLAUDE_CODE"])
    if not path.exists():
        message = f"Claude Code not installed ({path}); run scripts/claude_code.sh"
        if os.environ.get("HIVENET_REQUIRE_REAL_ENGINES") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return path


def test_claude_code_gets_an_answer(make_cluster: Cluster, tmp_path: Path) -> None:
    program = claude_code()
    auth = tmp_path / "auth.yaml"
    auth.write_text(
        "api:\n  mode: api-key\n  keys:\n"
        f'    - key_hash: "{hashlib.sha256(KEY.encode()).hexdigest()}"\n'
        "      metadata: {name: claude-code, owner: claude-code}\n"
    )
    router = make_cluster.router("--auth-config-file", str(auth))
    # A context as long as Claude Code assumes, and answers that end by themselves.
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
    home = tmp_path / "home"
    home.mkdir()
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": router.url,
        "ANTHROPIC_AUTH_TOKEN": KEY,
        "ANTHROPIC_DEFAULT_OPUS_MODEL": MODEL,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": MODEL,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": MODEL,
        # Nothing but the router is reachable from here.
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
    }
    done = subprocess.run(
        [str(program), "-p", "Say hello.", "--model", "sonnet", "--output-format", "json"],
        cwd=home,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:])
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["is_error"] is False, result
    assert result["result"].strip()  # the simulator's words, relayed
    text = router.metrics()
    assert metric(text, "hivenet_tenant_requests_success_total", tenant_id="claude-code") >= 1
    assert metric(text, "hivenet_tenant_requests_failed_total", tenant_id="claude-code") is None
