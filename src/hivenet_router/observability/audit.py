"""The audit record: one JSON line per finished request, as an observer.

The record carries who asked (tenant, key, source address), for what (model), how it ended
(status, error code, tokens, who answered) and how long it took, in the reference's field
names, then the notes stages left (`Ticket.note`: a cache result, a charge), in their
places. It never carries a prompt, an answer, a header or a credential. Liveness probes are
not audited. Lines are written by a LineWriter thread, so the request path only builds one
small JSON object.
"""

from __future__ import annotations

import functools
import math
import time
from datetime import datetime
from typing import Final

import orjson

from hivenet_router.auth.providers import ANONYMOUS
from hivenet_router.observability.events import AgentEvent, Ended, Event
from hivenet_router.observability.linewriter import LineWriter
from hivenet_router.pipeline.ticket import Key, Note, Ticket

DEFAULT_PATH = "/var/log/hivenet-router/audit.jsonl"
SKIPPED = frozenset({"/health"})  # probes: frequent, and they say nothing about anyone
MODEL_CHARS = 256  # a model name is the client's text: bounded in the record
# A request for no route is recorded under the endpoint "unmatched" (metrics label it, so it
# stays one value); the edge leaves what was asked in these notes, read by the request log
# too: the method and the path (no query string), each the client's text, bounded.
METHOD_CHARS, PATH_CHARS = 16, 256
ASKED_METHOD: Final = Note[str]("method", place=50)
ASKED_PATH: Final = Note[str]("path", place=51)
# The record, once made, beside the event it tells (see record).
LINE: Final = Key[tuple[Ended | None, bytes]]("audit_line", lambda: (None, b""))

# The code an error status gets when nothing more specific was attached to the request.
_BY_STATUS = {
    400: "request_invalid",
    401: "unauthorized",
    403: "model_forbidden",
    404: "model_not_found",
    429: "rate_limit_exceeded",
    499: "client_closed_request",
    503: "no_agents_available",
    504: "request_timeout",
}


def error_code(event: Ended) -> str:
    """The request's error code: the one attached to it, else one derived from the status,
    else "" (it succeeded)."""
    if event.code is not None:
        return event.code.value
    if event.status < 400:
        return ""
    return _BY_STATUS.get(event.status, "backend_error")


def answered_by(ticket: Ticket) -> str:
    """The agent's peer ID, or `provider:NAME` for provider fallback, or "" when neither."""
    if ticket.provider and ticket.origin:
        return f"provider:{ticket.origin}"
    return ticket.origin


@functools.lru_cache(maxsize=8)
def _second(whole: int) -> tuple[str, str]:
    """One second's local date and time, and its UTC offset. Working out the local zone
    costs more than the rest of a record, so it is done once per second, not per line."""
    moment = datetime.fromtimestamp(whole).astimezone()
    return moment.strftime("%Y-%m-%dT%H:%M:%S"), moment.isoformat()[19:]


def start_time(seconds_ago: float, now: float) -> str:
    """The request's start as local time with its UTC offset, to the millisecond."""
    wall = now - seconds_ago
    whole = math.floor(wall)
    head, zone = _second(whole)
    return f"{head}.{min(int((wall - whole) * 1000), 999):03d}{zone}"


class AuditObserver:
    observes = frozenset({Ended})  # the fan-out calls on_event for these alone

    def __init__(self, writer: LineWriter) -> None:
        self.writer = writer

    def on_event(self, ticket: Ticket, event: Event) -> None:
        if type(event) is not Ended or ticket.endpoint in SKIPPED:
            return
        self.writer.put(record(ticket, event, time.time()))

    def on_agent(self, event: AgentEvent) -> None:
        return None


def record(ticket: Ticket, event: Ended, now: float) -> bytes:
    """The audit line (with its newline) for a request that ended as `event` says.

    Made once a request: the audit writer and the console's recent requests both want it
    (a request ends once), and the second asks for the bytes the first made."""
    told, made = ticket.get(LINE)
    if told is event:
        return made
    principal = ticket.principal
    usage = event.usage
    fields: dict[str, object] = {
        "log_type": "audit",
        "level": "error" if event.status >= 400 else "info",
        "trace_id": ticket.trace_id,
        "request_id": ticket.request_id,
        "tenant_id": principal.tenant if principal is not None else "",
        "key_id": "" if principal is None or principal is ANONYMOUS else principal.key_id,
        "model": ticket.model[:MODEL_CHARS],
        "status_code": event.status,
        "latency_ms": round(event.seconds * 1000),
        "input_tokens": usage.input_tokens if usage is not None else 0,
        "output_tokens": usage.output_tokens if usage is not None else 0,
        "agent_id": answered_by(ticket),
        "error_code": error_code(event),
        "source_ip": ticket.source_ip,
        "ts": start_time(event.seconds, now),
    }
    # Stages note only what they did, so a record of a request that met none of them has
    # exactly the reference's fields; a note never replaces one of those.
    for name, value in ticket.notes():
        fields.setdefault(name, value)
    line = orjson.dumps(fields, option=orjson.OPT_APPEND_NEWLINE)
    ticket.put(LINE, (event, line))
    return line
