"""Codex CLI (`@openai/codex`, installed by scripts/codex_cli.sh) run headless against a
router: where it is, the configuration that points it at the router, and one `codex exec`.

Codex reads its settings from `$CODEX_HOME/config.toml`; a custom provider there names the
router's base URL, the Responses wire API and the environment variable holding the key.
Each run gets a CODEX_HOME of its own, so nothing of the user's configuration counts.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.real.engines import printed_paths

PROVIDER = "hivenet"
KEY_VARIABLE = "HIVENET_API_KEY"


def codex_cli() -> Path:
    """The installed `codex`; skip when it is not (fail under HIVENET_REQUIRE_REAL_ENGINES)."""
    path = Path(printed_paths("codex_cli.sh")["CODEX_CLI"])
    if not path.exists():
        message = f"Codex CLI not installed ({path}); run scripts/codex_cli.sh"
        if os.environ.get("HIVENET_REQUIRE_REAL_ENGINES") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return path


def codex_config(base_url: str, model: str) -> str:
    """config.toml for a router at `base_url` (its root, without /v1) serving `model`.

    No retries, so a failure shows at once; no update check, as nothing but the router is
    reachable; a context window stated, since Codex has no metadata for a made-up model."""
    return "\n".join(
        [
            f'model = "{model}"',
            f'model_provider = "{PROVIDER}"',
            "check_for_update_on_startup = false",
            "model_context_window = 262144",
            # The router runs no hosted tools (docs/responses.md): Codex must not offer one.
            'web_search = "disabled"',
            "",
            f"[model_providers.{PROVIDER}]",
            'name = "Hivenet Router"',
            f'base_url = "{base_url.rstrip("/")}/v1"',
            f'env_key = "{KEY_VARIABLE}"',
            'wire_api = "responses"',
            "request_max_retries = 0",
            "stream_max_retries = 0",
            "",
        ]
    )


@dataclass
class CodexRun:
    returncode: int
    events: list[dict[str, Any]]  # the JSONL events of `codex exec --json`
    last_message: str
    stderr: str

    def messages(self) -> list[str]:
        """The agent's messages, in order."""
        return [
            str(event["item"].get("text", ""))
            for event in self.events
            if event.get("type") == "item.completed"
            and event.get("item", {}).get("type") == "agent_message"
        ]

    def failed(self) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("type") in ("error", "turn.failed")]


def run_codex(
    program: Path,
    home: Path,
    base_url: str,
    model: str,
    key: str,
    prompt: str,
    extra_config: str = "",
) -> CodexRun:
    """One headless `codex exec` in `home` (its CODEX_HOME and working folder);
    `extra_config` is appended to its config.toml (an MCP server, say)."""
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text(codex_config(base_url, model) + extra_config)
    last = home / "last-message.txt"
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "CODEX_HOME": str(home),
        KEY_VARIABLE: key,
    }
    done = subprocess.run(
        [
            str(program),
            "exec",
            "--skip-git-repo-check",
            "--ephemeral",
            "--json",
            "--output-last-message",
            str(last),
            prompt,
        ],
        cwd=home,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    text = last.read_text() if last.exists() else ""
    return CodexRun(done.returncode, events, text, done.stderr)
