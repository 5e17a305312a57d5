"""OpenTelemetry traces through real processes: client -> router -> agent -> engine.

The router and the agent export to an OTLP/gRPC receiver the test starts (tests/otlp.py);
the simulator reports the traceparent each request reached it with."""

from __future__ import annotations

import os
import secrets
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import openai
import pytest

from tests.otlp import BlackHole, Receiver, Span
from tests.procs import Cluster, Router, Sim, cluster, metric, wait_registered, wait_until

MODEL = "traced"


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Router, Sim, Receiver]]:
    receiver = Receiver()
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint}
    tmp: Path = tmp_path_factory.mktemp("tracing")
    try:
        with cluster(tmp) as c:
            router = c.router(env=env)
            sim = c.sim(MODEL, "--zero-latency")
            c.agent(router, sim, env=env)
            wait_registered(router, MODEL)
            yield router, sim, receiver
    finally:
        receiver.stop()


def new_ids() -> tuple[str, str]:
    return secrets.token_hex(16), secrets.token_hex(8)


def spans_of(receiver: Receiver, trace_id: str, names: set[str]) -> dict[str, Span]:
    found: dict[str, Span] = {}

    def arrived() -> bool:
        found.clear()
        found.update({span.name: span for span in receiver.of_trace(trace_id)})
        return names <= set(found)

    wait_until(arrived, timeout=15)
    return found


def audit_trace_id(router: Router, request_id: str) -> str:
    assert router.audit is not None
    found: list[str] = []

    def written() -> bool:
        for entry in router.audit_records():
            if entry["request_id"] == request_id:
                found.append(entry["trace_id"])
                return True
        return False

    wait_until(written, timeout=5)
    return found[0]


def test_one_trace_from_the_client_to_the_engine(
    traced: tuple[Router, Sim, Receiver],
) -> None:
    router, sim, receiver = traced
    trace_id, client_span = new_ids()
    rid = str(uuid.uuid4())
    with openai.OpenAI(
        base_url=router.url + "/v1",
        api_key="x",
        max_retries=0,
        default_headers={"traceparent": f"00-{trace_id}-{client_span}-01", "X-Request-ID": rid},
    ) as client:
        reply = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
    assert reply.headers["traceparent"].startswith(f"00-{trace_id}-")
    spans = spans_of(
        receiver,
        trace_id,
        {
            "POST /v1/chat/completions",
            "admission",
            "routing",
            "agent forward",
            "agent backend proxy",
        },
    )
    root = spans["POST /v1/chat/completions"]
    assert (root.service, root.parent_id) == ("hivenet-router", client_span)
    assert root.attributes["http.response.status_code"] == 200
    assert root.attributes["hivenet.request_id"] == rid
    assert reply.headers["traceparent"] == f"00-{trace_id}-{root.span_id}-01"
    assert spans["admission"].parent_id == root.span_id
    routing = spans["routing"]
    assert routing.parent_id == root.span_id
    assert spans["agent forward"].parent_id == routing.span_id
    proxy = spans["agent backend proxy"]
    assert (proxy.service, proxy.parent_id) == ("hivenet-agent", routing.span_id)
    # The engine was handed the agent's span as its parent.
    seen = httpx.get(sim.url + "/admin/traceparents", timeout=5).json()
    assert f"00-{trace_id}-{proxy.span_id}-01" in seen
    # The same trace ID in the audit record and the request log line.
    assert audit_trace_id(router, rid) == trace_id
    wait_until(lambda: f"trace_id={trace_id}" in router.proc.log(), timeout=5)


@pytest.mark.parametrize(
    "supplied",
    [
        "00-00000000000000000000000000000000-0000000000000001-01",  # an all-zero trace ID
        "00-ABCDEF0123456789ABCDEF0123456789-0123456789abcdef-01",  # upper case
        "ff-0123456789abcdef0123456789abcdef-0123456789abcdef-01",  # a forbidden version
        "garbage",
        "00-" + "a" * 5000,
    ],
)
def test_a_malformed_traceparent_starts_a_new_trace(
    traced: tuple[Router, Sim, Receiver], supplied: str
) -> None:
    router, _, receiver = traced
    rid = str(uuid.uuid4())
    reply = httpx.post(
        router.url + "/v1/chat/completions",
        headers={"traceparent": supplied, "X-Request-ID": rid},
        json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2},
        timeout=10,
    )
    assert reply.status_code == 200
    version, trace_id, span_id, flags = reply.headers["traceparent"].split("-")
    assert (version, flags, len(trace_id), len(span_id)) == ("00", "01", 32, 16)
    assert trace_id not in supplied.lower()
    assert audit_trace_id(router, rid) == trace_id
    spans = spans_of(receiver, trace_id, {"POST /v1/chat/completions"})
    assert spans["POST /v1/chat/completions"].parent_id == ""


def test_streams_and_refusals_are_traced(traced: tuple[Router, Sim, Receiver]) -> None:
    router, _, receiver = traced
    with httpx.stream(
        "POST",
        router.url + "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 5,
            "stream": True,
        },
        timeout=10,
    ) as streamed:
        streamed.read()
    trace_id = streamed.headers["traceparent"].split("-")[1]
    spans = spans_of(receiver, trace_id, {"POST /v1/chat/completions", "agent forward"})
    assert not spans["POST /v1/chat/completions"].error
    missing = httpx.post(
        router.url + "/v1/chat/completions",
        json={"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]},
        timeout=10,
    )
    assert missing.status_code == 404
    trace_id = missing.headers["traceparent"].split("-")[1]
    root = spans_of(receiver, trace_id, {"POST /v1/chat/completions"})["POST /v1/chat/completions"]
    assert root.error and root.attributes["http.response.status_code"] == 404
    assert "hivenet.model" not in root.attributes  # a client's made-up name stays out


def test_a_collector_that_hangs_or_is_down_costs_requests_nothing(
    make_cluster: Cluster,
) -> None:
    hole = BlackHole()
    try:
        for name, endpoint in (("hung", f"127.0.0.1:{hole.port}"), ("down", "127.0.0.1:9")):
            env = {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_EXPORTER_OTLP_TIMEOUT": "1"}
            router = make_cluster.router(name=name, env=env)
            with httpx.Client(base_url=router.url, timeout=10) as http:
                for _ in range(50):
                    assert http.get("/v1/models").status_code == 200
                assert "traceparent" not in http.get("/health").headers  # probes: no trace
            wait_until(
                lambda r=router: (
                    (metric(r.metrics(), "hivenet_trace_spans_dropped_total") or 0) > 0
                ),
                timeout=20,
            )
            assert metric(router.metrics(), "hivenet_trace_spans_exported_total") == 0
            assert router.proc.popen is not None
            started = time.monotonic()
            os.kill(router.proc.popen.pid, signal.SIGTERM)
            router.proc.popen.wait(timeout=30)
            assert time.monotonic() - started < 30  # a bounded shutdown, not a target
    finally:
        hole.stop()


def test_a_trace_the_client_does_not_sample_is_passed_on_unrecorded(
    traced: tuple[Router, Sim, Receiver],
) -> None:
    router, sim, receiver = traced
    trace_id, client_span = new_ids()
    reply = httpx.post(
        router.url + "/v1/chat/completions",
        headers={"traceparent": f"00-{trace_id}-{client_span}-00"},
        json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2},
        timeout=10,
    )
    assert reply.status_code == 200
    version, answered_trace, _, flags = reply.headers["traceparent"].split("-")
    assert (version, answered_trace, flags) == ("00", trace_id, "00")
    seen = httpx.get(sim.url + "/admin/traceparents", timeout=5).json()
    assert any(v.startswith(f"00-{trace_id}-") and v.endswith("-00") for v in seen)
    # A sampled request sent afterwards is exported; by then this one would have been too.
    test_streams_and_refusals_are_traced(traced)
    assert receiver.of_trace(trace_id) == []
