"""Every public route's answers, checked against the official OpenAI and Anthropic specs.

Two backends: the engine simulator and real llama.cpp servers. What the router writes
itself (model lists, errors) must match the specs exactly; what a backend writes passes
through, and the few places a backend departs from the spec are named in allowlist.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx2 as httpx
import orjson
import pytest

from tests.conformance import specs
from tests.conformance.allowlist import ALLOWED
from tests.procs import Cluster, Router, cluster, wait_registered
from tests.real.engines import CHAT_MODEL, EMBED_MODEL, artefacts, embedding_agent, llama_server

ANTHROPIC = {"anthropic-version": "2023-06-01"}
OPENAI_MODEL = "/v1/models/{model}"
ANTHROPIC_MODEL = "/v1/models/{model_id}"


@dataclass(frozen=True)
class Backend:
    name: str
    router: Router
    chat: str
    embed: str


def _sim_fleet(c: Cluster) -> Backend:
    router = c.router()
    chat = c.sim("sim-chat", "--zero-latency", name="sim-chat")
    embed = c.sim("sim-embed", "--zero-latency", name="sim-embed")
    c.agent(router, chat, name="agent-chat")
    c.agent(router, embed, "--capability", "embedding", name="agent-embed")
    wait_registered(router, "sim-chat")
    wait_registered(router, "sim-embed")
    return Backend("sim", router, "sim-chat", "sim-embed")


def _llama_fleet(c: Cluster) -> Backend:
    found = artefacts()
    router = c.router()
    chat = llama_server(c, found, "llama-chat")
    embed = llama_server(c, found, "llama-embed", embeddings=True)
    c.agent(router, None, "--engine", "llama-cpp", name="agent-chat", backend_url=chat.url)
    embedding_agent(c, router, embed.url)
    wait_registered(router, CHAT_MODEL, timeout=30)
    wait_registered(router, EMBED_MODEL, timeout=30)
    return Backend("llamacpp", router, CHAT_MODEL, EMBED_MODEL)


@pytest.fixture(scope="module", params=["sim", "llamacpp"])
def backend(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Backend]:
    tmp: Path = tmp_path_factory.mktemp(f"conformance-{request.param}")
    with cluster(tmp) as c:
        yield _sim_fleet(c) if request.param == "sim" else _llama_fleet(c)


@dataclass(frozen=True)
class Call:
    """One request and the spec schema its answer (or each streamed event) must match."""

    id: str
    spec: str
    method: str
    route: str
    body: dict[str, object] | None = None
    headers: dict[str, str] = field(default_factory=dict)
    error: bool = False  # the router must refuse it with a 4xx
    stream_schema: str = ""  # set for streams: the schema of each event's data
    template: str = ""  # the route as the spec writes it, when it has a path parameter

    @property
    def spec_route(self) -> str:
        return self.template or self.route


def calls(model: str, embedder: str) -> list[Call]:
    chat = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5}
    prompt = {"model": model, "prompt": "Once", "max_tokens": 5}
    unknown = {**chat, "model": "nope"}
    no_messages = {"model": model}
    return [
        Call("models", "openai", "GET", "/v1/models"),
        Call("model", "openai", "GET", f"/v1/models/{model}", template=OPENAI_MODEL),
        Call("chat", "openai", "POST", "/v1/chat/completions", chat),
        Call(
            "chat-stream",
            "openai",
            "POST",
            "/v1/chat/completions",
            {**chat, "stream": True, "stream_options": {"include_usage": True}},
            stream_schema="CreateChatCompletionStreamResponse",
        ),
        Call("completion", "openai", "POST", "/v1/completions", prompt),
        Call(
            "completion-stream",
            "openai",
            "POST",
            "/v1/completions",
            {**prompt, "stream": True},
            stream_schema="CreateCompletionResponse",
        ),
        Call("embeddings", "openai", "POST", "/v1/embeddings", {"model": embedder, "input": "hi"}),
        Call("messages", "anthropic", "POST", "/v1/messages", chat, ANTHROPIC),
        Call(
            "messages-stream",
            "anthropic",
            "POST",
            "/v1/messages",
            {**chat, "stream": True},
            ANTHROPIC,
            stream_schema="MessageStreamEvent",
        ),
        Call(
            "count-tokens",
            "anthropic",
            "POST",
            "/v1/messages/count_tokens",
            {"model": model, "messages": chat["messages"]},
            ANTHROPIC,
        ),
        Call("anthropic-models", "anthropic", "GET", "/v1/models", headers=ANTHROPIC),
        Call(
            "anthropic-model",
            "anthropic",
            "GET",
            f"/v1/models/{model}",
            headers=ANTHROPIC,
            template=ANTHROPIC_MODEL,
        ),
        # Errors the router writes itself, on routes of both specs.
        Call("unknown-model", "openai", "POST", "/v1/chat/completions", unknown, error=True),
        Call("no-messages", "openai", "POST", "/v1/chat/completions", no_messages, error=True),
        Call("missing-model", "openai", "GET", "/v1/models/x", template=OPENAI_MODEL, error=True),
        Call("messages-unknown", "anthropic", "POST", "/v1/messages", unknown, ANTHROPIC, True),
        Call("messages-bad-json", "anthropic", "POST", "/v1/messages", None, ANTHROPIC, True),
        Call(
            "anthropic-missing-model",
            "anthropic",
            "GET",
            "/v1/models/x",
            headers=ANTHROPIC,
            template=ANTHROPIC_MODEL,
            error=True,
        ),
    ]


CALL_IDS = [call.id for call in calls("", "")]


def _check(b: Backend, call: Call, spec: str, schema: str, instance: object) -> list[str]:
    """Violations not explained by the allowlist, as readable lines."""
    unexplained = []
    for found in specs.violations(spec, schema, instance):
        if (b.name, *found.key) not in ALLOWED:
            unexplained.append(f"{call.id}: {found}")
    return unexplained


@pytest.mark.parametrize("call_id", CALL_IDS)
def test_answers_match_the_official_spec(backend: Backend, call_id: str) -> None:
    call = next(c for c in calls(backend.chat, backend.embed) if c.id == call_id)
    body = b"{not json" if call.body is None else orjson.dumps(call.body)
    reply = httpx.request(
        call.method,
        backend.router.url + call.route,
        content=body if call.method == "POST" else None,
        headers={"content-type": "application/json", **call.headers},
        timeout=60,
    )
    if call.error:
        assert 400 <= reply.status_code < 500, reply.text
    else:
        assert reply.status_code == 200, reply.text
    problems: list[str] = []
    if call.stream_schema:
        assert reply.headers["content-type"].startswith("text/event-stream")
        events = specs.sse_events(reply.text)
        assert events, reply.text
        for _, data in events:
            problems += _check(backend, call, call.spec, call.stream_schema, orjson.loads(data))
    else:
        assert reply.headers["content-type"].startswith("application/json")
        schema = specs.response_schema(call.spec, call.spec_route, call.method, reply.status_code)
        problems += _check(backend, call, call.spec, schema, reply.json())
    if call.error:
        # The one envelope satisfies the other specification's error schema as well.
        other = "anthropic" if call.spec == "openai" else "openai"
        problems += _check(backend, call, other, "ErrorResponse", reply.json())
    assert not problems, "\n".join(problems)
