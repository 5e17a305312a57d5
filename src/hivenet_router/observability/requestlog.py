"""The application's request log: one line per finished request, as an observer.

The line carries what joins it to everything else about the request (request ID, trace ID,
tenant, model, the agent that answered) and how it went (route, status, error code,
duration), in the format the process logs in (`--log-format text|json`). It is the
`hivenet.access` logger's: `--log-level access=warn` turns it off. Liveness probes are not
logged. Like audit records, lines are written by a LineWriter thread (to standard error),
so a slow terminal or journal never stalls a request.
"""

from __future__ import annotations

import logging
import time

import orjson

from hivenet_router.observability.audit import SKIPPED, answered_by, error_code
from hivenet_router.observability.events import AgentEvent, Ended, Event
from hivenet_router.observability.linewriter import LineWriter
from hivenet_router.pipeline.ticket import Ticket

LOGGER = "hivenet.access"
_PLAIN = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_./:@+")


def _text_value(value: str) -> str:
    """A value as it appears after `key=`: bare when it is plain, JSON-quoted otherwise, so
    a client's model name can neither split the line nor forge another field."""
    if value and _PLAIN.issuperset(value):
        return value
    return orjson.dumps(value).decode()


class RequestLog:
    def __init__(self, writer: LineWriter, fmt: str) -> None:
        self.writer = writer
        self.json = fmt == "json"
        self._logger = logging.getLogger(LOGGER)

    def on_event(self, ticket: Ticket, event: Event) -> None:
        if type(event) is not Ended or ticket.endpoint in SKIPPED:
            return
        if not self._logger.isEnabledFor(logging.INFO):
            return
        self.writer.put(self.line(ticket, event, time.time()))

    def on_agent(self, event: AgentEvent) -> None:
        return None

    def line(self, ticket: Ticket, event: Ended, now: float) -> bytes:
        principal = ticket.principal
        fields = {
            "request_id": ticket.request_id,
            "trace_id": ticket.trace_id,
            "endpoint": ticket.endpoint,
            "status": event.status,
            "error_code": error_code(event),
            "duration_ms": round(event.seconds * 1000, 1),
            "tenant": principal.tenant if principal is not None else "",
            "model": ticket.model[:256],
            "peer_id": answered_by(ticket),
            "source_ip": ticket.source_ip,
        }
        level = "warning" if event.status >= 500 else "info"
        if self.json:
            stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(now))
            head = {"ts": stamp, "level": level, "logger": LOGGER, "msg": "request"}
            return orjson.dumps(head | fields, option=orjson.OPT_APPEND_NEWLINE)
        millis = int(now * 1000) % 1000
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now))
        text = " ".join(f"{key}={_text_value(str(value))}" for key, value in fields.items())
        return f"{stamp},{millis:03d} {level.upper()} {LOGGER}: {text}\n".encode()
