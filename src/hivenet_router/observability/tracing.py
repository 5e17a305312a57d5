"""OpenTelemetry traces of requests: a stage that carries the trace to the agent, an
observer that records the spans, and an exporter thread behind a bounded buffer.

Off unless `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set;
then the standard `OTEL_*` variables configure it (sampler, service name, headers,
timeout, protocol). Off, nothing here is imported and a request pays nothing.

One request is one trace (or joins the client's, from a valid W3C `traceparent`):

    POST /v1/chat/completions        SERVER, arrival to last byte
    ├── admission                    the gates, parked waits included
    └── routing                      admitted to the answer's head (or to giving up)
        ├── queue wait               waiting for a free slot
        ├── attempt                  a forward that failed (one per try)
        └── agent forward            CLIENT, the forward that answered; the agent's own
                                     span and the engine's continue from `routing`

Spans are made when the events that end them arrive, with their true start times; the
request path only emits the events it emits anyway. Finished spans go to a bounded buffer
that a thread drains into the OTLP exporter, so a collector that is down or slow costs
requests nothing: past the buffer's bound spans are dropped, and counted.
"""

from __future__ import annotations

import logging
import random
import re
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from hivenet_router.domain.answer import Answer
from hivenet_router.observability.audit import SKIPPED
from hivenet_router.observability.events import (
    Admitted,
    AgentEvent,
    AnswerHead,
    Attempt,
    Ended,
    Event,
    Exhausted,
    Queued,
    Refused,
)
from hivenet_router.pipeline.stage import Next
from hivenet_router.pipeline.ticket import Ticket

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
    """A span processor: finished spans into a bounded deque, exported in batches by one
    thread. Spans past the bound, and batches the exporter refused, are counted."""

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

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        return None

    def _on_ending(self, span: Any) -> None:
        return None

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

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        self._wake.set()
        return True

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


class _Trace:
    """One request's spans while it runs."""

    __slots__ = ("admission_from", "root", "routing")

    def __init__(self, root: Any) -> None:
        self.root = root
        self.routing: Any = None
        self.admission_from = 0


class Tracing:
    """The stage, the observer and the edge's hook in one: they share the tracer."""

    name = "tracing"

    def __init__(self, environ: Mapping[str, str], service: str = "hivenet-router") -> None:
        from opentelemetry import trace
        from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, TraceFlags

        self.provider, self.buffer = _provider(environ, service)
        self.tracer = self.provider.get_tracer("hivenet_router")
        self.sampler = Sampler(environ)
        self._trace = trace
        self._remote = (NonRecordingSpan, SpanContext, TraceFlags)
        self._server, self._client = SpanKind.SERVER, SpanKind.CLIENT

    def close(self) -> None:
        self.provider.shutdown()

    # -- the edge: a request arrives ----------------------------------------------------------

    def begin(self, ticket: Ticket, method: str, supplied: str | None) -> None:
        """Open the request's span (in the client's trace when its traceparent is valid) and
        answer with the request's own traceparent. Liveness probes are not traced."""
        if ticket.endpoint in SKIPPED:
            return
        parent = None
        found = parse_traceparent(supplied)
        if not self.sampler.sampled(found):
            # Not recorded, but still one trace: the request gets an ID of its own, answers
            # with it and passes it on unsampled (flags 00), so no one downstream records.
            trace_id = found[0] if found is not None else random.getrandbits(128) or 1
            value = traceparent(trace_id, random.getrandbits(64) or 1, False)
            ticket.trace_id = f"{trace_id:032x}"
            ticket.headers_out["traceparent"] = value
            ticket.trace = value  # a string: what the stage hands the agent
            return
        if found is not None:
            span_class, context_class, flags = self._remote
            remote = context_class(found[0], found[1], is_remote=True, trace_flags=flags(found[2]))
            parent = self._trace.set_span_in_context(span_class(remote))
        root = self.tracer.start_span(
            f"{method} {ticket.endpoint}",
            context=parent,
            kind=self._server,
            attributes={"http.request.method": method, "http.route": ticket.endpoint},
        )
        context = root.get_span_context()
        ticket.trace = _Trace(root)
        ticket.trace_id = f"{context.trace_id:032x}"
        ticket.headers_out["traceparent"] = traceparent(
            context.trace_id, context.span_id, context.trace_flags.sampled
        )

    # -- the stage: before admission ----------------------------------------------------------

    async def __call__(self, ticket: Ticket, next: Next) -> Answer:
        state = ticket.trace
        if isinstance(state, _Trace):
            state.admission_from = time.time_ns()
        elif state is not None and ticket.job is not None:
            _hand_on(ticket.job.headers, state)  # unsampled: the agent sees flags 00
            ticket.trace = None
        return await next(ticket)

    # -- the observer -------------------------------------------------------------------------

    def on_agent(self, event: AgentEvent) -> None:
        return None

    def on_event(self, ticket: Ticket, event: Event) -> None:
        state = ticket.trace
        if not isinstance(state, _Trace):
            return
        now = time.time_ns()
        if isinstance(event, Admitted):
            self._admitted(ticket, state, now)
        elif isinstance(event, Refused):
            self._child(state.root, "admission", state.admission_from or now, now, event.code.value)
        elif isinstance(event, Queued):
            self._child(state.routing, "queue wait", now - _ns(event.seconds), now)
        elif isinstance(event, Attempt):
            self._child(
                state.routing,
                "attempt",
                now - _ns(event.seconds),
                now,
                event.code.value,
                attributes={"hivenet.peer_id": event.agent},
            )
        elif isinstance(event, AnswerHead):
            self._head(state, event, now)
        elif isinstance(event, Exhausted):
            self._end_routing(state, now, "exhausted")
        elif isinstance(event, Ended):
            self._ended(ticket, state, event, now)

    def _admitted(self, ticket: Ticket, state: _Trace, now: int) -> None:
        root = state.root
        self._child(root, "admission", state.admission_from or now, now)
        routing = state.routing = self.tracer.start_span(
            "routing", context=self._trace.set_span_in_context(root), start_time=now
        )
        job = ticket.job
        if job is not None:
            # The agent (and the engine behind it) continue the trace from here.
            context = routing.get_span_context()
            value = traceparent(context.trace_id, context.span_id, context.trace_flags.sampled)
            _hand_on(job.headers, value)

    def _head(self, state: _Trace, event: AnswerHead, now: int) -> None:
        name = f"provider {event.origin}" if event.provider else "agent forward"
        parent = state.routing or state.root  # provider fallback comes after routing gave up
        attributes = {"hivenet.peer_id": event.origin}
        if event.step_name:
            attributes["hivenet.policy_step"] = event.step_name
        start = now - _ns(event.seconds)
        self._child(parent, name, start, now, kind=self._client, attributes=attributes)
        self._end_routing(state, now)

    def _end_routing(self, state: _Trace, now: int, error: str = "") -> None:
        routing, state.routing = state.routing, None
        if routing is not None:
            if error:
                _fail(routing, error)
            routing.end(end_time=now)

    def _ended(self, ticket: Ticket, state: _Trace, event: Ended, now: int) -> None:
        ticket.trace = None
        root = state.root
        code = event.code.value if event.code is not None else ""
        self._end_routing(state, now, code)
        if root.is_recording():
            root.set_attribute("http.response.status_code", event.status)
            root.set_attribute("hivenet.request_id", ticket.request_id)
            if ticket.facts is not None and ticket.job is not None:
                root.set_attribute("hivenet.model", ticket.model)
            if ticket.origin:
                root.set_attribute("hivenet.peer_id", ticket.origin)
            if event.usage is not None:
                root.set_attribute("hivenet.input_tokens", event.usage.input_tokens)
                root.set_attribute("hivenet.output_tokens", event.usage.output_tokens)
            if code or event.status >= 500:
                _fail(root, code or str(event.status))
        root.end(end_time=now)

    def _child(
        self,
        parent: Any,
        name: str,
        start: int,
        end: int,
        error: str = "",
        kind: Any = None,
        attributes: dict[str, str] | None = None,
    ) -> None:
        """A finished child span of `parent` (nothing when the parent is not sampled).
        Everything is set before it ends: an ended span takes no more attributes."""
        if parent is None or not parent.is_recording():
            return
        span = self.tracer.start_span(
            name,
            context=self._trace.set_span_in_context(parent),
            start_time=start,
            attributes=attributes,
            **({"kind": kind} if kind is not None else {}),
        )
        if error:
            _fail(span, error)
        span.end(end_time=end)


def _hand_on(headers: list[tuple[str, str]], value: str) -> None:
    """Replace the forwarded request's traceparent (the client's, if any) with `value`."""
    headers[:] = [(k, v) for k, v in headers if k.lower() != "traceparent"]
    headers.append(("traceparent", value))


def _ns(seconds: float) -> int:
    return int(seconds * 1_000_000_000)


def _fail(span: Any, description: str) -> None:
    from opentelemetry.trace import Status, StatusCode

    span.set_status(Status(StatusCode.ERROR, description))
    span.set_attribute("error.type", description)


def _provider(environ: Mapping[str, str], service: str) -> tuple[Any, SpanBuffer]:
    """A tracer provider named `service` (unless OTEL_SERVICE_NAME says otherwise), its
    sampler from OTEL_TRACES_SAMPLER, exporting through a SpanBuffer."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider

    resource = Resource.create({})
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource.create({"service.name": service}))
    from opentelemetry.sdk.trace.sampling import ALWAYS_ON

    buffer = SpanBuffer(exporter_from_env(environ))
    # Sampling is decided before a span is made (Sampler, or the router's flag for the
    # agent): every span that reaches the SDK is kept.
    provider = TracerProvider(resource=resource, sampler=ALWAYS_ON)
    provider.add_span_processor(buffer)  # type: ignore[arg-type]
    return provider, buffer


class AgentTracing:
    """The agent's span around the engine call, a child of the trace the router sent;
    the engine is handed this span's context, so an instrumented engine continues it."""

    def __init__(self, environ: Mapping[str, str]) -> None:
        from opentelemetry import trace
        from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, TraceFlags

        self.provider, self.buffer = _provider(environ, "hivenet-agent")
        self.tracer = self.provider.get_tracer("hivenet_router.agent")
        self._trace = trace
        self._remote = (NonRecordingSpan, SpanContext, TraceFlags)
        self._client = SpanKind.CLIENT

    def start(self, path: str, headers: list[tuple[str, str]]) -> Any:
        """Open the span for one forwarded request and put its traceparent in `headers`
        (in place of the router's). None when the request carries no valid trace."""
        supplied = next((v for k, v in headers if k.lower() == "traceparent"), None)
        found = parse_traceparent(supplied)
        if found is None or not found[2] & 1:
            return None  # no trace, or one the router does not record: passed on as it is
        span_class, context_class, flags = self._remote
        remote = context_class(found[0], found[1], is_remote=True, trace_flags=flags(found[2]))
        span = self.tracer.start_span(
            "agent backend proxy",
            context=self._trace.set_span_in_context(span_class(remote)),
            kind=self._client,
            attributes={"url.path": path},
        )
        context = span.get_span_context()
        value = traceparent(context.trace_id, context.span_id, context.trace_flags.sampled)
        headers[:] = [(k, v) for k, v in headers if k.lower() != "traceparent"]
        headers.append(("traceparent", value))
        return span

    def close(self) -> None:
        self.provider.shutdown()


class TracingCollector(Collector):
    """Spans exported, and spans dropped (buffer full or the collector refused them)."""

    def __init__(self, buffer: SpanBuffer) -> None:
        self._buffer = buffer

    def collect(self) -> Iterable[Metric]:
        exported = CounterMetricFamily(
            "hivenet_trace_spans_exported", "Spans sent to the collector"
        )
        exported.add_metric([], self._buffer.exported)
        dropped = CounterMetricFamily(
            "hivenet_trace_spans_dropped",
            "Spans lost: the export buffer was full, or the collector could not take them",
        )
        dropped.add_metric([], self._buffer.dropped)
        yield from (exported, dropped)
