"""Every public route through router and agent to a simulator, with the official SDKs."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx2 as httpx
import openai
import pytest

from tests.procs import Cluster, Router, cluster, metric, wait_registered, wait_until

MODEL = "sim-chat"
EMBED = "sim-embed"
RERANK = "sim-rerank"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, Router]]:
    tmp: Path = tmp_path_factory.mktemp("fleet")
    with cluster(tmp) as c:
        router = c.router()
        chat = c.sim(MODEL, "--zero-latency", name="sim-chat")
        embed = c.sim(EMBED, "--zero-latency", name="sim-embed")
        rerank = c.sim(RERANK, "--zero-latency", name="sim-rerank")
        c.agent(router, chat, name="agent-chat")
        c.agent(router, embed, "--capability", "embedding", name="agent-embed")
        c.agent(router, rerank, "--capability", "reranker", name="agent-rerank")
        for model in (MODEL, EMBED, RERANK):
            wait_registered(router, model)
        yield c, router


@pytest.fixture
def oai(fleet: tuple[Cluster, Router]) -> Iterator[openai.OpenAI]:
    with fleet[1].openai("unused") as c:
        yield c


@pytest.fixture
def claude(fleet: tuple[Cluster, Router]) -> Iterator[anthropic.Anthropic]:
    with fleet[1].anthropic("unused") as c:
        yield c


def test_models_list_and_retrieve(oai: openai.OpenAI) -> None:
    ids = {m.id for m in oai.models.list()}
    assert {MODEL, EMBED, RERANK} <= ids
    assert oai.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as info:
        oai.models.retrieve("no-such-model")
    assert info.value.body["code"] == "model_not_found"  # type: ignore[index]


def test_chat_completion(oai: openai.OpenAI) -> None:
    reply = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=8
    )
    assert reply.choices[0].message.content
    assert reply.usage is not None and reply.usage.completion_tokens == 8
    assert reply.choices[0].finish_reason == "length"


def test_chat_stream_with_usage(oai: openai.OpenAI) -> None:
    chunks = list(
        oai.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(text.split()) == 12
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 12


def test_completions(oai: openai.OpenAI) -> None:
    reply = oai.completions.create(model=MODEL, prompt="once upon", max_tokens=5)
    assert reply.choices[0].text
    streamed = list(oai.completions.create(model=MODEL, prompt="once", max_tokens=4, stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices).strip()


def test_messages(claude: anthropic.Anthropic) -> None:
    reply = claude.messages.create(
        model=MODEL,
        max_tokens=6,
        messages=[{"role": "user", "content": "hi"}],
        system="be brief",
    )
    assert reply.content[0].type == "text" and reply.content[0].text
    assert reply.usage.output_tokens == 6
    assert reply.stop_reason == "max_tokens"
    assert reply._request_id is not None and uuid.UUID(reply._request_id)  # the SDK's place
    with pytest.raises(anthropic.NotFoundError) as info:
        claude.messages.create(
            model="nobody-serves-this", max_tokens=6, messages=[{"role": "user", "content": "x"}]
        )
    assert info.value.request_id is not None and uuid.UUID(info.value.request_id)


def test_messages_stream(claude: anthropic.Anthropic) -> None:
    with claude.messages.stream(
        model=MODEL, max_tokens=10, messages=[{"role": "user", "content": "hi"}]
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert len(text.split()) == 10
    assert final.usage.output_tokens == 10


def test_count_tokens(claude: anthropic.Anthropic) -> None:
    count = claude.messages.count_tokens(
        model=MODEL, messages=[{"role": "user", "content": "count these words please"}]
    )
    assert count.input_tokens > 0


def test_embeddings(oai: openai.OpenAI) -> None:
    reply = oai.embeddings.create(model=EMBED, input=["alpha", "beta"])
    assert len(reply.data) == 2
    assert len(reply.data[0].embedding) == 384
    floats = oai.embeddings.create(model=EMBED, input="alpha", encoding_format="float")
    assert floats.data[0].embedding == pytest.approx(reply.data[0].embedding, rel=1e-5)


def test_rerank(fleet: tuple[Cluster, Router]) -> None:
    reply = httpx.post(
        fleet[1].url + "/v1/rerank",
        json={"model": RERANK, "query": "red fox", "documents": ["a red fox", "blue sky"]},
        timeout=10,
    )
    assert reply.status_code == 200
    results = reply.json()["results"]
    assert results[0]["index"] == 0


def test_capability_is_enforced(oai: openai.OpenAI) -> None:
    # The embedding agent does not serve chat, and no other agent of the model does: the
    # client's mistake, a 400 the SDK does not retry (a 503 was retried three times).
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model=EMBED, messages=[{"role": "user", "content": "x"}])
    assert info.value.body["code"] == "invalid_parameter"  # type: ignore[index]
    assert info.value.body["param"] == "model"  # type: ignore[index]


def test_tokens_are_accounted(oai: openai.OpenAI, fleet: tuple[Cluster, Router]) -> None:
    before = metric(fleet[1].metrics(), "hivenet_agent_output_tokens_total", model=MODEL)
    oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "a"}], max_tokens=7
    )
    list(
        oai.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "a"}],
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    wait_until(
        lambda: (
            metric(fleet[1].metrics(), "hivenet_agent_output_tokens_total", model=MODEL)
            == before + 12
        )
    )
