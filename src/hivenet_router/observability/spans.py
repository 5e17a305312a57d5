"""The span core that the router's and the agent's tracing share, and the agent's span.

The W3C traceparent, the sampler, the export buffer and its thread, and finished spans
built from plain timings. Apart from the router's stage and observer (tracing.py) so that
the agent, which only wraps its engine call in a span, imports none of the router's
request path.
"""

from __future__ import annotations

import logging
import random
import re
import threading
import time
from collections import deque
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.sdk.trace.export import SpanExporter

log = logging.getLogger("hivenet.tracing")

_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?\Z")
MAX_TRACEPARENT = 512


def parse_traceparent(value: str | None) -> tuple[int, int, int] | None:
    """(trace ID, parent span ID, flags) of a valid W3C traceparent, else None: a malformed
    one starts a new trace rather than joining a forged or broken one."""
    if not value or len(value) > MAX_TRACEPARENT:
        return None
    match = _TRACEPARENT.match(value.strip())
    if match is None:
        return None
    version, trace, parent, flags, rest = match.groups()
    if version == "ff" or (version == "00" and rest):
        return None
    trace_id, span_id = int(trace, 16), int(parent, 16)
    if trace_id == 0 or span_id == 0:
        return None
    return trace_id, span_id, int(flags, 16)


def traceparent(trace_id: int, span_id: int, sampled: bool) -> str:
    return f"00-{trace_id:032x}-{span_id:016x}-{'01' if sampled else '00'}"


def configured(environ: Mapping[str, str]) -> bool:
    """Is tracing asked for? An endpoint set, and the SDK not switched off."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
        return False
    return bool(
        environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
        or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
    )


def exporter_from_env(environ: Mapping[str, str]) -> SpanExporter:
    """The OTLP exporter the variables ask for: gRPC by default (as the Go router), HTTP with
    `OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf`. A bare `host:port` endpoint means plain
    gRPC, as it does for the Go router."""
    protocol = (
        environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "grpc"
    ).strip()
    if protocol.startswith("http"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter as HttpExporter,
        )

        return HttpExporter()
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
        OTLPSpanExporter as GrpcExporter,
    )

    endpoint = (
        environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or ""
    ).strip()
    insecure = None
    if "://" not in endpoint and "OTEL_EXPORTER_OTLP_INSECURE" not in environ:
        insecure = True
    return GrpcExporter(endpoint=endpoint or None, insecure=insecure)


class SpanBuffer:
    """Finished spans into a bounded deque, exported in batches by one thread. Spans past
    the bound, and batches the exporter refused, are counted."""

    def __init__(
        self, exporter: SpanExporter, *, limit: int = 4096, batch: int = 512, delay: float = 1.0
    ) -> None:
        self.exporter = exporter
        self.limit = limit
        self.batch = batch
        self.delay = delay
        self.exported = 0  # counted by the export thread
        self.failed = 0  # ditto: batches the exporter could not deliver
        self._full = 0  # counted by the thread that ends spans (the event loop)
        self._spans: deque[ReadableSpan] = deque()
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="span-export", daemon=True)
        self._thread.start()

    @property
    def dropped(self) -> int:
        return self._full + self.failed

    def on_end(self, span: ReadableSpan) -> None:
        spans = self._spans
        if len(spans) >= self.limit:
            self._full += 1
            return
        spans.append(span)
        if len(spans) == 1:
            self._wake.set()

    def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(5.0)
        self.exporter.shutdown()

    def _run(self) -> None:
        from opentelemetry.sdk.trace.export import SpanExportResult

        while not self._stopping:
            self._wake.wait()
            self._wake.clear()
            if not self._stopping:
                time.sleep(self.delay)  # gather a batch
            while self._spans:
                batch: list[ReadableSpan] = []
                while self._spans and len(batch) < self.batch:
                    batch.append(self._spans.popleft())
                try:
                    ok = self.exporter.export(batch) is SpanExportResult.SUCCESS
                except Exception:  # an exporter bug must not kill the thread
                    log.exception("span export failed")
                    ok = False
                if ok:
                    self.exported += len(batch)
                else:
                    self.failed += len(batch)


class Sampler:
    """The standard samplers `OTEL_TRACES_SAMPLER` names, decided before any span exists:
    a request the sampler drops costs two random numbers, not an SDK span per step.
    `parentbased_*` follow a client's sampled flag when it sent a valid traceparent."""

    NAMES = (
        "always_on",
        "always_off",
        "traceidratio",
        "parentbased_always_on",
        "parentbased_always_off",
        "parentbased_traceidratio",
    )

    def __init__(self, environ: Mapping[str, str]) -> None:
        name = environ.get("OTEL_TRACES_SAMPLER", "").strip().lower() or "parentbased_always_on"
        if name not in self.NAMES:
            log.warning("OTEL_TRACES_SAMPLER=%s is not a standard sampler; sampling all", name)
            name = "parentbased_always_on"
        rate = 1.0
        if name.endswith("traceidratio"):
            try:
                rate = min(max(float(environ.get("OTEL_TRACES_SAMPLER_ARG", "1.0")), 0.0), 1.0)
            except ValueError:
                log.warning("OTEL_TRACES_SAMPLER_ARG is not a number; sampling all")
        self.follow_parent = name.startswith("parentbased_")
        self.rate = 0.0 if name.endswith("always_off") else rate

    def sampled(self, parent: tuple[int, int, int] | None) -> bool:
        if parent is not None and self.follow_parent:
            return bool(parent[2] & 1)
        return self.rate >= 1.0 or (self.rate > 0.0 and random.random() < self.rate)


def new_span_id() -> int:
    return random.getrandbits(64) or 1


class Spans:
    """What the router's and the agent's tracing share: the service's resource, the
    export buffer, and finished spans built from plain timings. (Not the SDK's tracer,
    whose per-span machinery of sampler calls, locks and attribute checks cost about 70 us
    a span here.)"""

    def __init__(self, environ: Mapping[str, str], service: str, scope: str) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import ReadableSpan
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope
        from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

        resource = Resource.create({})  # OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES
        if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
            resource = resource.merge(Resource.create({"service.name": service}))
        self.buffer = SpanBuffer(exporter_from_env(environ))
        self._resource = resource
        self._scope = InstrumentationScope(scope)
        self._make = (ReadableSpan, SpanContext, TraceFlags(1))
        self._kinds = (SpanKind.INTERNAL, SpanKind.SERVER, SpanKind.CLIENT)
        self._ok, self._failed = Status(StatusCode.UNSET), (Status, StatusCode.ERROR)

    def close(self) -> None:
        """Send what is queued (one last, bounded, try) and stop the export thread."""
        self.buffer.shutdown()

    def emit(
        self,
        trace_id: int,
        span: tuple[str, int, int, int, int, int, dict[str, Any], str],
        remote_parent: bool = False,
    ) -> None:
        """Queue one finished span: (name, span ID, parent span ID or 0, start, end, kind
        index (internal, server, client), attributes, error code or "")."""
        readable, context, sampled = self._make
        name, span_id, parent_id, start, end, kind, attributes, error = span
        status = self._ok
        if error:
            attributes = {**attributes, "error.type": error}
            status = self._failed[0](self._failed[1], error)
        self.buffer.on_end(
            readable(
                name=name,
                context=context(trace_id, span_id, False, sampled),
                parent=context(trace_id, parent_id, remote_parent, sampled) if parent_id else None,
                resource=self._resource,
                attributes=attributes,
                kind=self._kinds[kind],
                status=status,
                start_time=start,
                end_time=end,
                instrumentation_scope=self._scope,
            )
        )


def hand_on(headers: list[tuple[str, str]], value: str) -> None:
    """Replace the forwarded request's traceparent (the client's, if any) with `value`."""
    headers[:] = [(k, v) for k, v in headers if k.lower() != "traceparent"]
    headers.append(("traceparent", value))


def nanoseconds(seconds: float) -> int:
    return int(seconds * 1_000_000_000)


class AgentTracing(Spans):
    """The agent's span around the engine call, a child of the trace the router sent;
    the engine is handed this span's context, so an instrumented engine continues it."""

    def __init__(self, environ: Mapping[str, str]) -> None:
        super().__init__(environ, "hivenet-agent", "hivenet_router.agent")

    def start(self, path: str, headers: list[tuple[str, str]]) -> _AgentSpan | None:
        """Open the span for one forwarded request and put its traceparent in `headers`
        (in place of the router's). None when the request carries no valid trace."""
        supplied = next((v for k, v in headers if k.lower() == "traceparent"), None)
        found = parse_traceparent(supplied)
        if found is None or not found[2] & 1:
            return None  # no trace, or one the router does not record: passed on as it is
        span = _AgentSpan(self, found[0], found[1], path)
        hand_on(headers, traceparent(found[0], span.span_id, True))
        return span


class _AgentSpan:
    __slots__ = ("parent_id", "path", "span_id", "started", "trace_id", "tracing")

    def __init__(self, tracing: AgentTracing, trace_id: int, parent_id: int, path: str) -> None:
        self.tracing = tracing
        self.trace_id, self.parent_id, self.path = trace_id, parent_id, path
        self.span_id = new_span_id()
        self.started = time.time_ns()

    def end(self) -> None:
        self.tracing.emit(
            self.trace_id,
            (
                "agent backend proxy",
                self.span_id,
                self.parent_id,
                self.started,
                time.time_ns(),
                2,
                {"url.path": self.path},
                "",
            ),
            remote_parent=True,
        )
