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

A span's times are noted when the events that end it arrive (the request path only emits
the events it emits anyway); when the request ends its spans are built at once and go to
a bounded buffer that a thread drains into the OTLP exporter, so a collector that is down
or slow costs requests nothing: past the buffer's bound spans are dropped, and counted.
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


class _Trace:
    """One sampled request's spans while it runs: IDs, start times and the finished
    children, turned into spans for the exporter in one go when the request ends."""

    __slots__ = (
        "admission_from",
        "children",
        "name",
        "parent",
        "root_id",
        "routing_from",
        "routing_id",
        "started",
        "trace_id",
    )

    def __init__(self, trace_id: int, parent: int, name: str) -> None:
        self.trace_id = trace_id
        self.parent = parent  # the client's span, or 0
        self.root_id = _span_id()
        self.name = name
        self.started = time.time_ns()
        self.admission_from = 0
        self.routing_id = 0  # set while routing is open
        self.routing_from = 0
        # (name, span ID, parent span ID, start, end, kind, attributes, error)
        self.children: list[tuple[str, int, int, int, int, int, dict[str, Any], str]] = []

    def child(
        self,
        name: str,
        parent: int,
        start: int,
        end: int,
        error: str = "",
        kind: int = 0,
        attributes: dict[str, Any] | None = None,
    ) -> int:
        span_id = _span_id()
        self.children.append((name, span_id, parent, start, end, kind, attributes or {}, error))
        return span_id


def _span_id() -> int:
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


class Tracing(Spans):
    """The stage, the observer and the edge's hook in one. A request's timings are kept as
    plain tuples while it runs and become finished spans when it ends."""

    name = "tracing"

    def __init__(self, environ: Mapping[str, str], service: str = "hivenet-router") -> None:
        super().__init__(environ, service, "hivenet_router")
        self.sampler = Sampler(environ)

    # -- the edge: a request arrives ----------------------------------------------------------

    def begin(self, ticket: Ticket, method: str, supplied: str | None) -> None:
        """Open the request's trace (the client's when its traceparent is valid) and answer
        with the request's own traceparent. Liveness probes are not traced."""
        if ticket.endpoint in SKIPPED:
            return
        found = parse_traceparent(supplied)
        trace_id = found[0] if found is not None else random.getrandbits(128) or 1
        if not self.sampler.sampled(found):
            # Not recorded, but still one trace: the request answers with it and passes it
            # on unsampled (flags 00), so no one downstream records either.
            value = traceparent(trace_id, _span_id(), False)
            ticket.trace_id = f"{trace_id:032x}"
            ticket.headers_out["traceparent"] = value
            ticket.trace = value  # a string: what the stage hands the agent
            return
        state = _Trace(
            trace_id, found[1] if found is not None else 0, f"{method} {ticket.endpoint}"
        )
        ticket.trace = state
        ticket.trace_id = f"{trace_id:032x}"
        ticket.headers_out["traceparent"] = traceparent(trace_id, state.root_id, True)

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
            state.child("admission", state.root_id, state.admission_from or now, now)
            state.routing_id, state.routing_from = _span_id(), now
            if ticket.job is not None:
                # The agent (and the engine behind it) continue the trace from here.
                _hand_on(ticket.job.headers, traceparent(state.trace_id, state.routing_id, True))
        elif isinstance(event, Refused):
            start = state.admission_from or now
            state.child("admission", state.root_id, start, now, event.code.value)
        elif isinstance(event, Queued) and state.routing_id:
            state.child("queue wait", state.routing_id, now - _ns(event.seconds), now)
        elif isinstance(event, Attempt) and state.routing_id:
            start = now - _ns(event.seconds)
            attributes = {"hivenet.peer_id": event.agent}
            state.child("attempt", state.routing_id, start, now, event.code.value, 0, attributes)
        elif isinstance(event, AnswerHead):
            self._head(state, event, now)
        elif isinstance(event, Exhausted):
            self._end_routing(state, now, "exhausted")
        elif isinstance(event, Ended):
            self._ended(ticket, state, event, now)

    def _head(self, state: _Trace, event: AnswerHead, now: int) -> None:
        name = f"provider {event.origin}" if event.provider else "agent forward"
        attributes = {"hivenet.peer_id": event.origin}
        if event.step_name:
            attributes["hivenet.policy_step"] = event.step_name
        # Provider fallback comes after routing gave up: its span hangs off the request's.
        parent = state.routing_id or state.root_id
        state.child(name, parent, now - _ns(event.seconds), now, "", 2, attributes)
        self._end_routing(state, now)

    def _end_routing(self, state: _Trace, now: int, error: str = "") -> None:
        if state.routing_id:
            start, state.routing_from = state.routing_from, 0
            span_id, state.routing_id = state.routing_id, 0
            state.children.append(("routing", span_id, state.root_id, start, now, 0, {}, error))

    def _ended(self, ticket: Ticket, state: _Trace, event: Ended, now: int) -> None:
        ticket.trace = None
        code = event.code.value if event.code is not None else ""
        self._end_routing(state, now, code)
        attributes: dict[str, Any] = {
            "http.request.method": ticket.method,
            "http.route": ticket.endpoint,
            "http.response.status_code": event.status,
            "hivenet.request_id": ticket.request_id,
        }
        if ticket.facts is not None and ticket.job is not None:
            attributes["hivenet.model"] = ticket.model
        if ticket.origin:
            attributes["hivenet.peer_id"] = ticket.origin
        if event.usage is not None:
            attributes["hivenet.input_tokens"] = event.usage.input_tokens
            attributes["hivenet.output_tokens"] = event.usage.output_tokens
        error = code or (str(event.status) if event.status >= 500 else "")
        root = (state.name, state.root_id, state.parent, state.started, now, 1, attributes, error)
        self.emit(state.trace_id, root, remote_parent=True)
        for span in state.children:
            self.emit(state.trace_id, span)


def _hand_on(headers: list[tuple[str, str]], value: str) -> None:
    """Replace the forwarded request's traceparent (the client's, if any) with `value`."""
    headers[:] = [(k, v) for k, v in headers if k.lower() != "traceparent"]
    headers.append(("traceparent", value))


def _ns(seconds: float) -> int:
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
        _hand_on(headers, traceparent(found[0], span.span_id, True))
        return span


class _AgentSpan:
    __slots__ = ("parent_id", "path", "span_id", "started", "trace_id", "tracing")

    def __init__(self, tracing: AgentTracing, trace_id: int, parent_id: int, path: str) -> None:
        self.tracing = tracing
        self.trace_id, self.parent_id, self.path = trace_id, parent_id, path
        self.span_id = _span_id()
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
