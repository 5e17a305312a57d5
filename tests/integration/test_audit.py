"""Audit records, request IDs, the request log and CORS, through real processes.

One router with client keys, one agent on the simulator; each test reads the audit file
the harness gave the router."""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2 as httpx
import openai
import pytest

from tests.integration.test_auth import auth_file, entry
from tests.procs import ADMIN_KEY, Cluster, Router, cluster, metric, wait_until

MODEL = "audited"
KEY = "sk-hivenet-audit-client"
SECRET_WORDS = "violet-narwhal-prompt"  # must never reach an audit record
ORIGIN = "https://app.example"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, Router, str]]:
    tmp: Path = tmp_path_factory.mktemp("audit")
    with cluster(tmp) as c:
        path = auth_file(tmp, entry(KEY, "acme"))
        router = c.router(
            "--auth-config-file", str(path), "--cors-allowed-origins", f"{ORIGIN},http://[::1]:3000"
        )
        sim = c.sim(MODEL, "--zero-latency")
        c.agent(router, sim)
        wait_until(lambda: MODEL in _listed(router))
        table = httpx.get(
            router.url + "/admin/routing-table",
            headers={"Authorization": f"Bearer {ADMIN_KEY}"},
            timeout=5,
        ).json()
        yield c, router, table["agents"][0]["peer_id"]


def _listed(router: Router) -> str:
    return httpx.get(
        router.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=5
    ).text


def records(router: Router, request_id: str, count: int = 1) -> list[dict[str, Any]]:
    """The audit records of one request (waiting for the writer thread to write them)."""
    assert router.audit is not None
    found: list[dict[str, Any]] = []

    def written() -> bool:
        found.clear()
        for record in router.audit_records():
            if record["request_id"] == request_id:
                found.append(record)
        return len(found) >= count

    wait_until(written, timeout=5)
    return found


def client(router: Router, request_id: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=router.url + "/v1",
        api_key=KEY,
        max_retries=0,
        default_headers={"X-Request-ID": request_id},
    )


def test_a_chat_request_is_audited_without_its_content(
    fleet: tuple[Cluster, Router, str],
) -> None:
    _, router, peer = fleet
    rid = str(uuid.uuid4())
    with client(router, rid) as oai:
        reply = oai.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": SECRET_WORDS}], max_tokens=8
        )
        answer = reply.parse()
    assert reply.headers["x-request-id"] == rid
    (entry,) = records(router, rid)
    assert entry["log_type"] == "audit" and entry["level"] == "info"
    assert (entry["tenant_id"], entry["key_id"], entry["model"]) == ("acme", "", MODEL)
    assert (entry["status_code"], entry["error_code"], entry["agent_id"]) == (200, "", peer)
    assert answer.usage is not None
    assert entry["input_tokens"] == answer.usage.prompt_tokens > 0
    assert entry["output_tokens"] == answer.usage.completion_tokens > 0
    assert entry["source_ip"] == "127.0.0.1"
    assert entry["trace_id"] == ""
    assert isinstance(entry["latency_ms"], int)
    assert router.audit is not None
    text = router.audit.read_text()
    assert SECRET_WORDS not in text
    assert KEY not in text
    content = answer.choices[0].message.content
    if content:
        assert content not in text


def test_a_stream_is_audited_after_its_last_chunk(fleet: tuple[Cluster, Router, str]) -> None:
    _, router, peer = fleet
    rid = str(uuid.uuid4())
    with client(router, rid) as oai:
        stream = oai.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
        usage = [chunk.usage for chunk in stream if chunk.usage is not None]
    (entry,) = records(router, rid)
    assert (entry["status_code"], entry["agent_id"]) == (200, peer)
    assert entry["output_tokens"] == usage[-1].completion_tokens > 0


def test_a_client_that_hangs_up_after_the_last_event_was_served(
    fleet: tuple[Cluster, Router, str],
) -> None:
    """SDKs close the connection as soon as they read `[DONE]`, often before the agent's
    end of stream reaches the router: that request succeeded (200), it did not lose its
    client (499)."""
    c, router, _ = fleet
    # An engine with a pace: its end of stream reaches the router apart from `[DONE]`.
    paced = "audited-paced"
    c.agent(router, c.sim(paced, "--itl", "2ms", "--ttft-base", "1ms", name="paced"), name="paced")
    wait_until(lambda: paced in _listed(router))
    ids = [str(uuid.uuid4()) for _ in range(20)]
    body = {"model": paced, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    for rid in ids:
        with httpx.Client(timeout=5) as http:
            headers = {"Authorization": f"Bearer {KEY}", "X-Request-ID": rid}
            url = router.url + "/v1/chat/completions"
            with http.stream("POST", url, json=body, headers=headers) as reply:
                for line in reply.iter_lines():
                    if line == "data: [DONE]":
                        break  # hang up at once, as the SDKs do
    statuses = [records(router, rid)[0]["status_code"] for rid in ids]
    assert statuses == [200] * len(ids)


@pytest.mark.parametrize("supplied", ["not-a-uuid", "8b9e4a6d" * 2000, "'; DROP TABLE"])
def test_an_invalid_request_id_is_replaced(
    fleet: tuple[Cluster, Router, str], supplied: str
) -> None:
    _, router, _ = fleet
    reply = httpx.get(
        router.url + "/v1/models",
        headers={"Authorization": f"Bearer {KEY}", "X-Request-ID": supplied},
        timeout=5,
    )
    assert reply.status_code == 200
    rid = reply.headers["x-request-id"]
    assert str(uuid.UUID(rid)) == rid and rid != supplied
    (entry,) = records(router, rid)
    assert entry["model"] == "" and entry["tenant_id"] == "acme"


def test_refusals_carry_their_code_and_what_was_known(
    fleet: tuple[Cluster, Router, str],
) -> None:
    _, router, _ = fleet
    rid = str(uuid.uuid4())
    with client(router, rid) as oai, pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "x"}]
        )
    (entry,) = records(router, rid)
    assert (entry["status_code"], entry["error_code"], entry["model"]) == (
        404,
        "model_not_found",
        "no-such-model",
    )
    assert entry["level"] == "error" and entry["agent_id"] == ""
    rid = str(uuid.uuid4())
    reply = httpx.post(
        router.url + "/v1/chat/completions",
        headers={"Authorization": "Bearer wrong", "X-Request-ID": rid},
        json={"model": MODEL, "messages": []},
        timeout=5,
    )
    assert reply.status_code == 401
    (entry,) = records(router, rid)
    assert (entry["tenant_id"], entry["error_code"], entry["model"]) == ("", "unauthorized", "")


def test_a_body_refused_as_invalid_is_recorded_under_its_model(
    fleet: tuple[Cluster, Router, str],
) -> None:
    """The body was read, so its model is known to the audit record, the request log and
    the tenant's failed requests, as for any other refusal; a made-up model's name creates
    no series."""
    _, router, _ = fleet
    before = metric(router.metrics(), "hivenet_tenant_requests_failed_total", model=MODEL) or 0
    bodies = (
        ("/v1/chat/completions", {"model": MODEL, "messages": []}),
        ("/v1/chat/completions", {"model": MODEL, "messages": [], "stream": "yes"}),
        ("/v1/responses", {"model": MODEL, "input": "x", "tools": [{"type": "web_search"}]}),
        ("/v1/chat/completions", {"model": "made-up-model", "messages": []}),
    )
    for path, body in bodies:
        rid = str(uuid.uuid4())
        reply = httpx.post(
            router.url + path,
            headers={"Authorization": f"Bearer {KEY}", "X-Request-ID": rid},
            json=body,
            timeout=5,
        )
        assert reply.status_code == 400, reply.text
        (entry,) = records(router, rid)
        assert entry["model"] == body["model"] and entry["status_code"] == 400
        (line,) = [line for line in router.proc.log().splitlines() if rid in line]
        assert f"model={body['model']}" in line, line
    text = router.metrics()
    assert metric(text, "hivenet_tenant_requests_failed_total", model=MODEL) == before + 3
    assert "made-up-model" not in text


def test_an_engines_refusal_is_recorded_with_the_code_the_client_got(
    fleet: tuple[Cluster, Router, str],
) -> None:
    _, router, _ = fleet
    rid = str(uuid.uuid4())
    with client(router, rid) as oai, pytest.raises(openai.BadRequestError) as refused:
        oai.chat.completions.create(  # past the simulator's 8192-token context
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=100_000
        )
    assert refused.value.code == "context_length_exceeded"
    (entry,) = records(router, rid)
    assert (entry["status_code"], entry["error_code"]) == (400, "context_length_exceeded")
    wait_until(lambda: f"request_id={rid}" in router.proc.log(), timeout=5)
    (line,) = [line for line in router.proc.log().splitlines() if rid in line]
    assert "status=400 error_code=context_length_exceeded" in line


def test_a_request_for_no_route_is_recorded_with_its_method_and_path(
    fleet: tuple[Cluster, Router, str],
) -> None:
    _, router, _ = fleet
    rid, long_rid = str(uuid.uuid4()), str(uuid.uuid4())
    reply = httpx.delete(
        router.url + "/v1/no/such/route?secret=hunter2",
        headers={"Authorization": f"Bearer {KEY}", "X-Request-ID": rid},
        timeout=5,
    )
    assert reply.status_code == 404
    long_path = "/v1/" + "a" * 2000
    assert httpx.get(router.url + long_path, headers={"X-Request-ID": long_rid}).status_code == 404
    (entry,) = records(router, rid)
    assert (entry["method"], entry["path"], entry["error_code"]) == (
        "DELETE",
        "/v1/no/such/route",
        "not_found",
    )
    (entry,) = records(router, long_rid)
    assert entry["path"] == long_path[:256]
    wait_until(lambda: f"request_id={long_rid}" in router.proc.log(), timeout=5)
    (line,) = [line for line in router.proc.log().splitlines() if rid in line]
    assert "method=DELETE path=/v1/no/such/route" in line and "hunter2" not in line
    (line,) = [line for line in router.proc.log().splitlines() if long_rid in line]
    assert f"method=GET path={long_path[:256]}\n" in line + "\n"
    assert "hunter2" not in router.proc.log()


def test_probes_and_preflights_are_not_audited(fleet: tuple[Cluster, Router, str]) -> None:
    _, router, _ = fleet
    assert router.audit is not None
    rid = str(uuid.uuid4())
    httpx.get(router.url + "/health", headers={"X-Request-ID": rid}, timeout=5)
    preflight = httpx.options(
        router.url + "/v1/chat/completions",
        headers={
            "Origin": ORIGIN,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
            "X-Request-ID": rid,
        },
        timeout=5,
    )
    assert preflight.status_code == 204  # answered without a key
    assert preflight.headers["x-request-id"] == rid
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    marker = str(uuid.uuid4())
    httpx.get(router.url + "/v1/models", headers={"X-Request-ID": marker}, timeout=5)
    records(router, marker)  # written after the probe and the preflight
    assert rid not in router.audit.read_text()


def test_cors_headers_reach_whole_streamed_and_error_answers(
    fleet: tuple[Cluster, Router, str],
) -> None:
    _, router, _ = fleet
    headers = {"Authorization": f"Bearer {KEY}", "Origin": ORIGIN}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 4}
    whole = httpx.post(router.url + "/v1/chat/completions", headers=headers, json=body, timeout=5)
    with httpx.stream(
        "POST",
        router.url + "/v1/chat/completions",
        headers=headers,
        json={**body, "stream": True},
        timeout=5,
    ) as streamed:
        streamed.read()
    error = httpx.post(
        router.url + "/v1/chat/completions", headers=headers, json={"model": 1}, timeout=5
    )
    for reply, status in ((whole, 200), (streamed, 200), (error, 400)):
        assert reply.status_code == status
        assert reply.headers["access-control-allow-origin"] == ORIGIN
        assert "X-Request-ID" in reply.headers["access-control-expose-headers"]
    other = httpx.get(
        router.url + "/v1/models",
        headers={"Authorization": f"Bearer {KEY}", "Origin": "https://evil.example"},
        timeout=5,
    )
    assert other.status_code == 200
    assert "access-control-allow-origin" not in other.headers


def test_each_request_gets_one_request_log_line(fleet: tuple[Cluster, Router, str]) -> None:
    _, router, _ = fleet
    rid = str(uuid.uuid4())
    with client(router, rid) as oai:
        oai.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": SECRET_WORDS}], max_tokens=4
        )
    wait_until(lambda: f"request_id={rid}" in router.proc.log(), timeout=5)
    (line,) = [line for line in router.proc.log().splitlines() if rid in line]
    assert "hivenet.access" in line and "status=200" in line and "tenant=acme" in line
    assert SECRET_WORDS not in router.proc.log() and KEY not in router.proc.log()


def test_audit_lines_are_counted_and_sighup_reopens_the_file(
    fleet: tuple[Cluster, Router, str],
) -> None:
    _, router, _ = fleet
    assert router.audit is not None and router.proc.popen is not None
    page = router.metrics()
    written = metric(page, "hivenet_log_lines_written_total", log="audit")
    assert written is not None and written > 0
    assert metric(page, "hivenet_log_lines_dropped_total", log="audit") == 0
    rotated = router.audit.with_suffix(".jsonl.1")
    router.audit.rename(rotated)
    os.kill(router.proc.popen.pid, signal.SIGHUP)
    wait_until(lambda: router.audit is not None and router.audit.exists(), timeout=5)
    rid = str(uuid.uuid4())
    httpx.get(
        router.url + "/v1/models",
        headers={"Authorization": f"Bearer {KEY}", "X-Request-ID": rid},
        timeout=5,
    )
    records(router, rid)
    assert rid not in rotated.read_text()


def test_an_unwritable_audit_path_falls_back_to_stdout(make_cluster: Cluster) -> None:
    blocker = make_cluster.tmp / "not-a-folder"
    blocker.write_text("")
    router = make_cluster.router(
        name="fallback", env={"HIVENET_ROUTER_AUDIT_LOG_PATH": str(blocker / "audit.jsonl")}
    )
    rid = str(uuid.uuid4())
    httpx.get(router.url + "/v1/models", headers={"X-Request-ID": rid}, timeout=5)
    wait_until(lambda: f'"request_id":"{rid}"' in router.proc.log(), timeout=5)
    assert router.proc.log().count("audit: cannot open") == 1


def test_a_full_disk_never_stalls_requests(make_cluster: Cluster) -> None:
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full")
    router = make_cluster.router(name="full", env={"HIVENET_ROUTER_AUDIT_LOG_PATH": "/dev/full"})
    started = time.monotonic()
    with httpx.Client(base_url=router.url, timeout=5) as http:
        for _ in range(200):
            assert http.get("/v1/models").status_code == 200
    assert time.monotonic() - started < 30  # bounded, not a latency target
    wait_until(
        lambda: metric(router.metrics(), "hivenet_log_lines_dropped_total", log="audit") == 200,
        timeout=5,
    )
    assert router.proc.log().count("writing to /dev/full failed") == 1
