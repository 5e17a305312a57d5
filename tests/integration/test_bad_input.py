"""Bad requests get documented statuses and codes, and never reach an agent."""

from __future__ import annotations

import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import openai
import orjson
import pytest

from tests.procs import Cluster, Router, Sim, cluster, metric, wait_registered

MODEL = "m"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Router, Sim]]:
    tmp: Path = tmp_path_factory.mktemp("bad")
    c: Cluster
    with cluster(tmp) as c:
        router = c.router("--max-request-bytes", "4096")
        sim = c.sim(MODEL, "--zero-latency")
        c.agent(router, sim)
        wait_registered(router, MODEL)
        yield router, sim


@pytest.fixture
def client(fleet: tuple[Router, Sim]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=fleet[0].url, timeout=10) as c:
        yield c


CHAT = "/v1/chat/completions"


@pytest.mark.parametrize(
    ("route", "body", "needle", "param"),
    [
        (CHAT, b"{not json", "malformed JSON", None),
        (CHAT, b"", "empty", None),
        (CHAT, b"[1, 2]", "JSON object", None),
        (
            CHAT,
            b'{"messages": [{"role": "user", "content": "x"}]}',
            "model field is required",
            "model",
        ),
        (CHAT, b'{"model": 7, "messages": []}', "`$.model`", "model"),
        (CHAT, b'{"model": "m", "messages": "hello"}', "`$.messages`", "messages"),
        (CHAT, b'{"model": "m", "messages": []}', "`$.messages`", "messages"),
        (CHAT, b'{"model": "m", "messages": [{}], "stream": "yes"}', "`$.stream`", "stream"),
        (
            CHAT,
            b'{"model": "m", "messages": [{}], "max_tokens": "ten"}',
            "`$.max_tokens`",
            "max_tokens",
        ),
        (CHAT, b'{"model": "' + b"x" * 300 + b'", "messages": [{}]}', "`$.model`", "model"),
        ("/v1/embeddings", b'{"model": "m"}', "`input`", "input"),
        ("/v1/rerank", b'{"model": "m", "query": "q"}', "`documents`", "documents"),
        ("/v1/completions", b'{"model": "m"}', "`prompt`", "prompt"),
        ("/v1/messages", b'{"model": "m", "max_tokens": 5}', "`messages`", "messages"),
    ],
)
def test_invalid_bodies(
    client: httpx.Client, route: str, body: bytes, needle: str, param: str | None
) -> None:
    reply = client.post(route, content=body, headers={"Content-Type": "application/json"})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["code"] == "request_invalid"
    assert error["type"] == "invalid_request_error"
    assert error["source"] == "router"
    assert needle in error["message"]
    assert error["param"] == param  # the field at fault, where OpenAI's SDKs look for it


def test_a_limit_the_router_does_not_count_is_replaced_by_its_bound(
    client: httpx.Client,
) -> None:
    """OpenAI's schema sets no minimum on max_tokens: the router does not refuse -1 itself
    but counts it as undeclared output, holds its bound for it, and sends the engine that
    bound in its place (llama.cpp reads -1 as no limit at all: a new user's 300-token key
    got 1,024 tokens); the answer stays within it."""
    reply = client.post(
        CHAT,
        json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": -1},
    )
    assert reply.status_code == 200, reply.text
    bound = int(reply.headers["X-Hivenet-Output-Bound"])
    assert 0 < reply.json()["usage"]["completion_tokens"] <= bound


def test_invalid_bodies_never_reach_the_engine(
    client: httpx.Client, fleet: tuple[Router, Sim]
) -> None:
    before = metric(fleet[1].metrics(), "hivenet_sim_requests_total")
    client.post(CHAT, content=b"{broken")
    client.post(CHAT, json={"model": "m"})
    assert metric(fleet[1].metrics(), "hivenet_sim_requests_total") == before


def test_oversized_body_is_413(client: httpx.Client) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 5000}]}
    reply = client.post(CHAT, json=body)
    assert reply.status_code == 413
    assert reply.json()["error"]["code"] == "request_too_large"


def _answer(sock: socket.socket) -> tuple[bytes, bytes]:
    """One answer's head and body, read from a keep-alive connection."""
    data = b""
    while b"\r\n\r\n" not in data:
        piece = sock.recv(65536)
        assert piece, f"the router closed the connection: {data!r}"
        data += piece
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    while len(body) < length:
        body += sock.recv(65536)
    return head, body


def _post(body: bytes, length: int | None = None) -> bytes:
    declared = len(body) if length is None else length
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%b" % (declared, body)
    )


def test_an_oversized_body_sent_whole_keeps_its_connection(fleet: tuple[Router, Sim]) -> None:
    """A 413 for a body that arrived whole: the connection serves the client's next
    request. One refused by its declared length before the body came is closed."""
    router = fleet[0]
    big = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * 9000}]})
    good = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    with socket.create_connection(("127.0.0.1", router.http), timeout=10) as sock:
        for _ in range(2):
            sock.sendall(_post(big))
            head, body = _answer(sock)
            assert head.startswith(b"HTTP/1.1 413") and b"connection: close" not in head.lower()
            assert orjson.loads(body)["error"]["code"] == "request_too_large"
            sock.sendall(_post(good))
            head, body = _answer(sock)
            assert head.startswith(b"HTTP/1.1 200"), body
    with socket.create_connection(("127.0.0.1", router.http), timeout=10) as sock:
        sock.sendall(_post(b"{", length=1 << 20))
        head, _ = _answer(sock)
        assert head.startswith(b"HTTP/1.1 413") and b"connection: close" in head.lower()
        sock.settimeout(5)
        assert sock.recv(100) == b""  # closed (after a moment of reading, not a reset)


def test_the_openai_sdk_goes_on_after_a_413(fleet: tuple[Router, Sim]) -> None:
    with openai.OpenAI(base_url=fleet[0].url + "/v1", api_key="unused", max_retries=0) as sdk:
        with pytest.raises(openai.APIStatusError) as refused:
            sdk.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "x" * 9000}]
            )
        assert refused.value.status_code == 413
        assert refused.value.code == "request_too_large"
        reply = sdk.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}]
        )
        assert reply.choices[0].message.content


def test_unknown_model_is_404(client: httpx.Client) -> None:
    reply = client.post(
        CHAT, json={"model": "nope", "messages": [{"role": "user", "content": "x"}]}
    )
    assert reply.status_code == 404
    assert reply.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize(
    "path",
    [
        "/v1/assistants",
        "/admin/agents",
        "/v1/chat",
        "/metrics",
        "/register",
        "/hivenet/link",
        "/v1/models/../../etc",
    ],
)
def test_unknown_paths_are_404(client: httpx.Client, path: str) -> None:
    reply = client.post(path, json={"model": MODEL})
    assert reply.status_code == 404
    assert reply.json()["error"]["code"] == "not_found"


def test_a_path_without_its_v1_says_so(client: httpx.Client) -> None:
    reply = client.post("/chat/completions", json={"model": MODEL})
    assert reply.status_code == 404 and reply.json()["error"]["code"] == "not_found"
    assert "did you mean /v1/chat/completions?" in reply.json()["error"]["message"]
    other = client.post("/nothing/here", json={"model": MODEL})
    assert "did you mean" not in other.json()["error"]["message"]


def test_wrong_method_is_405(client: httpx.Client) -> None:
    reply = client.get(CHAT)
    assert reply.status_code == 405
    assert reply.json()["error"]["code"] == "method_not_allowed"
    assert reply.headers["Allow"] == "POST"  # RFC 9110
    assert client.request("OPTIONS", CHAT).status_code == 405  # not a preflight


def test_a_preflight_with_no_origin_allowed_is_refused(client: httpx.Client) -> None:
    """No origin is allowed by default (docs/observability.md, CORS): a browser's preflight
    is refused as one from an origin not listed, with its request ID."""
    mine = str(uuid.uuid4())
    headers = {
        "Origin": "https://app.example",
        "Access-Control-Request-Method": "POST",
        "X-Request-ID": mine,
    }
    reply = client.request("OPTIONS", CHAT, headers=headers)
    assert reply.status_code == 400 and reply.headers["X-Request-ID"] == mine
    body = reply.json()
    assert body["error"]["code"] == "request_invalid" and body["request_id"] == mine
    assert "access-control-allow-origin" not in reply.headers


def test_request_ids(client: httpx.Client) -> None:
    mine = str(uuid.uuid4())
    assert client.get("/health", headers={"X-Request-ID": mine}).headers["X-Request-ID"] == mine
    replaced = client.get("/health", headers={"X-Request-ID": "not-a-uuid"})
    assert uuid.UUID(replaced.headers["X-Request-ID"])
    error = client.post(CHAT, content=b"{")
    assert uuid.UUID(error.headers["X-Request-ID"])


def test_backend_rejections_keep_their_status(client: httpx.Client) -> None:
    # Anthropic-style error from the engine: classified, status kept (the Go router made it
    # a 502 backend_error).
    reply = client.post(
        "/v1/messages",
        json={"model": MODEL, "max_tokens": 100000, "messages": [{"role": "user", "content": "x"}]},
    )
    assert reply.status_code == 400
    assert reply.json()["error"]["code"] == "context_length_exceeded"


def test_made_up_models_leave_no_trace_in_metrics(
    client: httpx.Client, fleet: tuple[Router, Sim]
) -> None:
    for index in range(3):
        reply = client.post(
            CHAT, json={"model": f"made-up-{index}", "messages": [{"role": "user", "content": "x"}]}
        )
        assert reply.json()["error"]["code"] == "model_not_found"
    assert "made-up-" not in fleet[0].metrics()
