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

import random
import time
from collections.abc import Iterable, Mapping
from typing import Any, Final

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
from hivenet_router.observability.spans import (
    Sampler,
    SpanBuffer,
    Spans,
    hand_on,
    nanoseconds,
    new_span_id,
    parse_traceparent,
    traceparent,
)
from hivenet_router.pipeline.stage import Next
from hivenet_router.pipeline.ticket import Key, Ticket


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
        self.root_id = new_span_id()
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
        span_id = new_span_id()
        self.children.append((name, span_id, parent, start, end, kind, attributes or {}, error))
        return span_id


# The tracer's own record of a request: its spans while it runs (sampled), the traceparent
# the stage hands the agent (unsampled), or None (not traced, or already handed on).
TRACE: Final = Key[_Trace | str | None]("trace", lambda: None)


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
            value = traceparent(trace_id, new_span_id(), False)
            ticket.trace_id = f"{trace_id:032x}"
            ticket.headers_out["traceparent"] = value
            ticket.put(TRACE, value)  # a string: what the stage hands the agent
            return
        state = _Trace(
            trace_id, found[1] if found is not None else 0, f"{method} {ticket.endpoint}"
        )
        ticket.put(TRACE, state)
        ticket.trace_id = f"{trace_id:032x}"
        ticket.headers_out["traceparent"] = traceparent(trace_id, state.root_id, True)

    # -- the stage: before admission ----------------------------------------------------------

    async def __call__(self, ticket: Ticket, next: Next) -> Answer:
        state = ticket.get(TRACE)
        if isinstance(state, _Trace):
            state.admission_from = time.time_ns()
        elif state is not None and ticket.job is not None:
            hand_on(ticket.job.headers, state)  # unsampled: the agent sees flags 00
            ticket.put(TRACE, None)
        return await next(ticket)

    # -- the observer -------------------------------------------------------------------------

    def on_agent(self, event: AgentEvent) -> None:
        return None

    def on_event(self, ticket: Ticket, event: Event) -> None:
        state = ticket.get(TRACE)
        if not isinstance(state, _Trace):
            return
        now = time.time_ns()
        if isinstance(event, Admitted):
            state.child("admission", state.root_id, state.admission_from or now, now)
            state.routing_id, state.routing_from = new_span_id(), now
            if ticket.job is not None:
                # The agent (and the engine behind it) continue the trace from here.
                hand_on(ticket.job.headers, traceparent(state.trace_id, state.routing_id, True))
        elif isinstance(event, Refused):
            start = state.admission_from or now
            state.child("admission", state.root_id, start, now, event.code.value)
        elif isinstance(event, Queued) and state.routing_id:
            state.child("queue wait", state.routing_id, now - nanoseconds(event.seconds), now)
        elif isinstance(event, Attempt) and state.routing_id:
            start = now - nanoseconds(event.seconds)
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
        state.child(name, parent, now - nanoseconds(event.seconds), now, "", 2, attributes)
        self._end_routing(state, now)

    def _end_routing(self, state: _Trace, now: int, error: str = "") -> None:
        if state.routing_id:
            start, state.routing_from = state.routing_from, 0
            span_id, state.routing_id = state.routing_id, 0
            state.children.append(("routing", span_id, state.root_id, start, now, 0, {}, error))

    def _ended(self, ticket: Ticket, state: _Trace, event: Ended, now: int) -> None:
        ticket.put(TRACE, None)
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
