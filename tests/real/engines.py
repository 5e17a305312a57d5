"""Real llama.cpp engines for the test suite, built by scripts/real_engines.sh."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import httpx2 as httpx
import pytest

from tests.procs import Cluster, Proc, Router, free_port, metric, wait_until

ROOT = Path(__file__).resolve().parents[2]
# A Gemma-style chat template of this project's that renders tools and tool calls, so that
# llama.cpp (with --jinja) parses the model's calls into structured tool_calls.
TOOLS_TEMPLATE = Path(__file__).with_name("tools_template.jinja")
CHAT_MODEL = "gemma-3-270m"
EMBED_MODEL = "all-minilm-l6-v2"


@dataclass(frozen=True)
class Artefacts:
    llama_server: Path
    chat_model: Path
    embed_model: Path


def printed_paths(script: str) -> dict[str, str]:
    """The KEY=VALUE lines a setup script prints with --print (it builds nothing then)."""
    printed = subprocess.run(
        ["bash", str(ROOT / "scripts" / script), "--print"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return dict(line.split("=", 1) for line in printed.splitlines() if "=" in line)


def artefacts() -> Artefacts:
    """Paths from the build script; skip (or fail, when the Makefile demands them) if absent."""
    paths = printed_paths("real_engines.sh")
    found = Artefacts(
        Path(paths["LLAMA_SERVER"]),
        Path(paths["LLAMA_CHAT_MODEL"]),
        Path(paths["LLAMA_EMBED_MODEL"]),
    )
    missing = [str(p) for p in vars(found).values() if not p.exists()]
    if missing:
        message = f"real engines not built ({', '.join(missing)}); run scripts/real_engines.sh"
        if os.environ.get("HIVENET_REQUIRE_REAL_ENGINES") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return found


@dataclass
class LlamaServer:
    proc: Proc
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=5).text

    def value(self, name: str) -> float:
        return metric(self.metrics(), f"llamacpp:{name}")


def llama_server(
    c: Cluster,
    found: Artefacts,
    name: str,
    *,
    embeddings: bool = False,
    slots: int = 2,
    tools: bool = False,
) -> LlamaServer:
    """One llama-server on a free loopback port, one thread, ready to serve. `tools` starts
    it with a Jinja chat template that handles tool calls."""
    port = free_port()
    if embeddings:
        model = ["-m", str(found.embed_model), "-a", EMBED_MODEL, "--embeddings"]
        model += ["--pooling", "mean", "-c", "512"]
    else:
        model = ["-m", str(found.chat_model), "-a", CHAT_MODEL, "-c", str(1024 * slots)]
        if tools:
            model += ["--jinja", "--chat-template-file", str(TOOLS_TEMPLATE)]
        else:
            model += ["--no-jinja", "--chat-template", "gemma"]
    args = [str(found.llama_server), *model, "-np", str(slots), "-t", "1", "--metrics"]
    proc = c.spawn(name, [*args, "--host", "127.0.0.1", "--port", str(port)])
    server = LlamaServer(proc, port)
    wait_until(lambda: httpx.get(server.url + "/health", timeout=2).status_code == 200, 90)
    return server


def embedding_agent(c: Cluster, router: Router, url: str, engine: str = "llama-cpp") -> Proc:
    """An agent that registers the engine at `url` as an embedding model."""
    extra = ("--engine", engine, "--capability", "embedding")
    return c.agent(router, None, *extra, name="agent-embed", backend_url=url)
