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
import re
import time

import orjson

from hivenet_router.observability.audit import (
    ASKED_METHOD,
    ASKED_PATH,
    SKIPPED,
    answered_by,
    error_code,
    start_time,
)
from hivenet_router.observability.events import AgentEvent, Ended, Event
from hivenet_router.observability.linewriter import LineWriter
from hivenet_router.pipeline.ticket import Ticket

LOGGER = "hivenet.access"
_PLAIN = re.compile(r"[A-Za-z0-9._:/@+-]+")


def _text_value(value: str) -> str:
    """A value as it appears after `key=`: bare when it is plain, JSON-quoted otherwise, so
    a client's model name can neither split the line nor forge another field."""
    if _PLAIN.fullmatch(value):
        return value
    return orjson.dumps(value).decode() if value else '""'


class RequestLog:
    observes = frozenset({Ended})  # the fan-out calls on_event for these alone

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
        tenant = principal.tenant if principal is not None else ""
        model, peer, code = ticket.model[:256], answered_by(ticket), error_code(event)
        level = "WARNING" if event.status >= 500 else "INFO"
        stamp = start_time(0.0, now)  # the line's own time, as the log formatter writes it
        asked = _asked(ticket)
        if self.json:
            entry = {
                "ts": stamp[:19],
                "level": level.lower(),
                "logger": LOGGER,
                "msg": "request",
                "request_id": ticket.request_id,
                "trace_id": ticket.trace_id,
                "endpoint": ticket.endpoint,
                "status": event.status,
                "error_code": code,
                "duration_ms": round(event.seconds * 1000, 1),
                "tenant": tenant,
                "model": model,
                "peer_id": peer,
                "source_ip": ticket.source_ip,
            }
            if asked is not None:
                entry["method"], entry["path"] = asked
            return orjson.dumps(entry, option=orjson.OPT_APPEND_NEWLINE)
        # IDs, routes and numbers are plain by construction; the rest is quoted when needed.
        q = _text_value
        return (
            f"{stamp[:10]} {stamp[11:19]},{stamp[20:23]} {level} {LOGGER}: "
            f"request_id={ticket.request_id} trace_id={q(ticket.trace_id)} "
            f"endpoint={q(ticket.endpoint)} status={event.status} error_code={q(code)} "
            f"duration_ms={event.seconds * 1000:.1f} tenant={q(tenant)} model={q(model)} "
            f"peer_id={q(peer)} source_ip={q(ticket.source_ip)}"
            + (f" method={q(asked[0])} path={q(asked[1])}\n" if asked else "\n")
        ).encode()


def _asked(ticket: Ticket) -> tuple[str, str] | None:
    """The method and path of a request for no route (the edge noted them), else None."""
    path = ticket.noted(ASKED_PATH)
    return None if path is None else (ticket.noted(ASKED_METHOD) or "", path)
