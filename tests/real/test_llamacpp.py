"""Router and agents in front of real llama.cpp servers, driven by the official SDKs.

The chat model is a 270M base model: its words are gibberish, so the tests check shapes,
token accounting and where requests went, never what the model said.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anthropic
import httpx2 as httpx
import openai
import pytest

from tests.procs import (
    ADMIN_KEY,
    Router,
    break_stream,
    cluster,
    metric,
    survivor_serves,
    wait_registered,
    wait_until,
)
from tests.real.engines import (
    CHAT_MODEL,
    EMBED_MODEL,
    Artefacts,
    LlamaServer,
    embedding_agent,
    llama_server,
)

PROMPT = [{"role": "user", "content": "Say hello."}]
AGENT = ("--engine", "llama-cpp", "--capacity", "2")


def admin_agents(router: Router) -> list[dict[str, object]]:
    table = httpx.get(
        router.url + "/admin/routing-table",
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
        timeout=5,
    ).json()
    agents: list[dict[str, object]] = table["agents"]
    return agents


@pytest.fixture(scope="module")
def fleet(
    tmp_path_factory: pytest.TempPathFactory, real: Artefacts
) -> Iterator[tuple[Router, list[LlamaServer]]]:
    tmp: Path = tmp_path_factory.mktemp("llama")
    with cluster(tmp) as c:
        router = c.router()
        engines = [llama_server(c, real, f"llama-{n}") for n in ("a", "b")]
        embed = llama_server(c, real, "llama-embed", embeddings=True)
        for n, engine in zip(("a", "b"), engines, strict=True):
            c.agent(router, None, *AGENT, name=f"agent-{n}", backend_url=engine.url)
        embedding_agent(c, router, embed.url)
        wait_registered(router, CHAT_MODEL, replicas=2, timeout=30)
        wait_registered(router, EMBED_MODEL, timeout=30)
        yield router, engines


@pytest.fixture
def oai(fleet: tuple[Router, list[LlamaServer]]) -> Iterator[openai.OpenAI]:
    with fleet[0].openai() as client:
        yield client


@pytest.fixture
def claude(fleet: tuple[Router, list[LlamaServer]]) -> Iterator[anthropic.Anthropic]:
    with fleet[0].anthropic() as client:
        yield client


def test_models_discovered_from_the_engines(oai: openai.OpenAI) -> None:
    ids = {model.id for model in oai.models.list()}
    assert {CHAT_MODEL, EMBED_MODEL} <= ids


def test_chat_completion(oai: openai.OpenAI) -> None:
    reply = oai.chat.completions.create(model=CHAT_MODEL, messages=PROMPT, max_tokens=6)  # type: ignore[arg-type]
    assert reply.choices[0].message.role == "assistant"
    assert isinstance(reply.choices[0].message.content, str)
    assert reply.usage is not None
    assert 0 < reply.usage.completion_tokens <= 6
    assert reply.usage.prompt_tokens > 0


def test_chat_stream_with_usage(oai: openai.OpenAI) -> None:
    stream = oai.chat.completions.create(
        model=CHAT_MODEL,
        messages=PROMPT,  # type: ignore[arg-type]
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = [c.usage for c in chunks if c.usage is not None]
    assert text
    assert len(usage) == 1
    assert 0 < usage[0].completion_tokens <= 6


def test_a_stream_without_include_usage_is_metered_with_the_engines_count(
    fleet: tuple[Router, list[LlamaServer]], oai: openai.OpenAI
) -> None:
    """The router asks llama.cpp for usage and keeps the usage event from this client."""
    router = fleet[0]
    request: dict[str, Any] = {
        "model": CHAT_MODEL, "messages": PROMPT, "max_tokens": 20, "stream": True,
        "temperature": 0,
    }  # fmt: skip
    rid = str(uuid.uuid4())
    chunks = list(oai.chat.completions.create(**request, extra_headers={"X-Request-ID": rid}))
    assert chunks and all(c.usage is None for c in chunks)
    asked = list(oai.chat.completions.create(**request, stream_options={"include_usage": True}))
    (usage,) = [c.usage for c in asked if c.usage is not None]  # greedy: the same answer
    found: list[dict[str, Any]] = []
    wait_until(
        lambda: (
            bool(found.extend(r for r in router.audit_records() if r["request_id"] == rid))
            or bool(found)
        )
    )
    assert (found[0]["input_tokens"], found[0]["output_tokens"]) == (
        usage.prompt_tokens,
        usage.completion_tokens,
    )


def test_completions(oai: openai.OpenAI) -> None:
    reply = oai.completions.create(model=CHAT_MODEL, prompt="Once upon a time", max_tokens=6)
    assert isinstance(reply.choices[0].text, str)
    assert reply.usage is not None
    assert 0 < reply.usage.completion_tokens <= 6


def test_anthropic_messages(claude: anthropic.Anthropic) -> None:
    reply = claude.messages.create(model=CHAT_MODEL, max_tokens=6, messages=PROMPT)  # type: ignore[arg-type]
    assert reply.role == "assistant"
    assert reply.content and reply.content[0].type == "text"
    assert 0 < reply.usage.output_tokens <= 6


def test_anthropic_messages_stream(claude: anthropic.Anthropic) -> None:
    with claude.messages.stream(model=CHAT_MODEL, max_tokens=6, messages=PROMPT) as stream:  # type: ignore[arg-type]
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text
    assert 0 < final.usage.output_tokens <= 6


def test_embeddings(oai: openai.OpenAI) -> None:
    reply = oai.embeddings.create(model=EMBED_MODEL, input=["a routing test", "another"])
    assert [len(item.embedding) for item in reply.data] == [384, 384]
    assert reply.usage.prompt_tokens > 0


def test_two_agents_share_the_load(
    fleet: tuple[Router, list[LlamaServer]], oai: openai.OpenAI
) -> None:
    router, engines = fleet
    before = [engine.value("tokens_predicted_total") for engine in engines]

    def one(_: int) -> int:
        reply = oai.chat.completions.create(model=CHAT_MODEL, messages=PROMPT, max_tokens=4)  # type: ignore[arg-type]
        assert reply.usage is not None
        return reply.usage.completion_tokens

    with ThreadPoolExecutor(6) as pool:
        produced = sum(pool.map(one, range(6)))
    after = [engine.value("tokens_predicted_total") for engine in engines]
    grown = [b - a for a, b in zip(before, after, strict=True)]
    assert all(g > 0 for g in grown), grown  # both engines decoded part of the burst
    assert sum(grown) == produced
    text = router.metrics()
    assert metric(text, "hivenet_router_active_forwards") == 0.0


def test_router_reads_live_llamacpp_metrics(fleet: tuple[Router, list[LlamaServer]]) -> None:
    router, _ = fleet

    def reported() -> bool:
        chat = [a for a in admin_agents(router) if a["metadata"]["model"] == CHAT_MODEL]  # type: ignore[index]
        engines = [a["engine"] for a in chat]
        return len(engines) == 2 and all(
            e and e.get("generation_tokens_total", 0) > 0  # type: ignore[attr-defined]
            for e in engines
        )

    wait_until(reported, timeout=10)


def _busy(engines: list[LlamaServer]) -> int:
    """The engine serving the one request in flight, by its own metrics."""
    found: list[int] = []

    def serving() -> bool:
        values = [e.value("requests_processing") for e in engines]
        found[:] = [n for n, v in enumerate(values) if v >= 1]
        return len(found) == 1

    wait_until(serving, timeout=5)
    return found[0]


@pytest.mark.parametrize("victim", ["engine", "agent"])
def test_one_killed_mid_stream(tmp_path: Path, real: Artefacts, victim: str) -> None:
    with cluster(tmp_path) as c:
        router = c.router()
        engines = [llama_server(c, real, f"llama-{n}", slots=1) for n in ("a", "b")]
        agents = [
            c.agent(
                router,
                None,
                "--engine",
                "llama-cpp",
                "--capacity",
                "1",
                name=f"agent-{n}",
                backend_url=e.url,
            )
            for n, e in zip(("a", "b"), engines, strict=True)
        ]
        wait_registered(router, CHAT_MODEL, replicas=2, timeout=30)
        with router.openai() as client:

            def kill() -> None:
                busy = _busy(engines)
                (engines[busy].proc if victim == "engine" else agents[busy]).kill()

            break_stream(client, CHAT_MODEL, kill, max_tokens=400)
            survivor_serves(router, client, CHAT_MODEL)
