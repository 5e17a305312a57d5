"""W3C trace context, when tracing is on, and the bounded span buffer."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from hivenet_router.observability.spans import (
    Sampler,
    SpanBuffer,
    configured,
    parse_traceparent,
    traceparent,
)
from tests.procs import wait_until

VALID = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_valid_traceparents_are_read() -> None:
    assert parse_traceparent(VALID) == (
        0x0AF7651916CD43DD8448EB211C80319C,
        0xB7AD6B7169203331,
        1,
    )
    # A later version may carry more fields; version 00 may not.
    assert parse_traceparent("01" + VALID[2:] + "-more") is not None
    assert parse_traceparent(VALID + "-more") is None


def test_malformed_traceparents_are_refused() -> None:
    for value in (
        None,
        "",
        "garbage",
        VALID.upper(),
        "ff" + VALID[2:],
        "00-00000000000000000000000000000000-b7ad6b7169203331-01",
        "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",
        "00-0af7651916cd43dd8448eb211c80319-b7ad6b7169203331-01",
        VALID + "x" * 1000,
    ):
        assert parse_traceparent(value) is None, value


def test_traceparent_round_trip() -> None:
    found = parse_traceparent(VALID)
    assert found is not None
    assert traceparent(found[0], found[1], True) == VALID


def test_tracing_is_on_only_with_an_endpoint() -> None:
    assert not configured({})
    assert not configured({"OTEL_EXPORTER_OTLP_ENDPOINT": "  "})
    assert configured({"OTEL_EXPORTER_OTLP_ENDPOINT": "tempo:4317"})
    assert configured({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"})
    assert not configured(
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "tempo:4317", "OTEL_SDK_DISABLED": "true"}
    )
    assert not configured({"OTEL_EXPORTER_OTLP_ENDPOINT": "c:4317", "OTEL_TRACES_EXPORTER": "none"})


class Stuck(SpanExporter):
    """An exporter whose collector never answers until released."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.calls = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.calls += 1
        self.release.wait(10)
        return SpanExportResult.FAILURE

    def shutdown(self) -> None:
        self.release.set()


def test_a_stuck_collector_drops_and_counts_but_never_blocks() -> None:
    exporter = Stuck()
    buffer = SpanBuffer(exporter, limit=10, batch=5, delay=0.001)
    buffer.on_end(ReadableSpan("first"))
    wait_until(lambda: exporter.calls == 1, timeout=5)  # the export thread is now stuck
    started = time.monotonic()
    for _ in range(100):
        buffer.on_end(ReadableSpan("more"))
    assert time.monotonic() - started < 1.0  # ending spans never waits on the exporter
    assert buffer.dropped == 90  # ten kept, the rest dropped and counted
    exporter.release.set()
    wait_until(lambda: buffer.dropped == 101, timeout=5)  # the refused batches count too
    assert buffer.exported == 0
    buffer.shutdown()


def test_the_standard_samplers() -> None:
    sampled_parent, unsampled_parent = (1, 1, 1), (1, 1, 0)
    default = Sampler({})
    assert default.sampled(None) and default.sampled(sampled_parent)
    assert not default.sampled(unsampled_parent)  # parent-based: the client said no
    off = Sampler({"OTEL_TRACES_SAMPLER": "always_off"})
    assert not any(off.sampled(None) for _ in range(100))
    on = Sampler({"OTEL_TRACES_SAMPLER": "always_on"})
    assert on.sampled(unsampled_parent)  # not parent-based: samples whatever the client said
    tenth = Sampler(
        {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.1"}
    )
    share = sum(tenth.sampled(None) for _ in range(20_000)) / 20_000
    assert 0.08 < share < 0.12
    assert tenth.sampled(sampled_parent)
    odd = Sampler({"OTEL_TRACES_SAMPLER": "jaeger_remote", "OTEL_TRACES_SAMPLER_ARG": "x"})
    assert odd.sampled(None)  # unknown: sample all, with a warning
