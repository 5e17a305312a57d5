"""Audit records: the reference's fields, what decides each, and what never appears."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import orjson

from hivenet_router.auth.providers import ANONYMOUS, Principal
from hivenet_router.domain.answer import Outcome
from hivenet_router.domain.errors import ErrorCode
from hivenet_router.domain.request import RequestFacts, Usage
from hivenet_router.gateway.cache import SERVED, UNBILLED
from hivenet_router.gateway.validator import REPLACED
from hivenet_router.gateway.wallet import CHARGED
from hivenet_router.observability.audit import AuditObserver, record
from hivenet_router.observability.events import Admitted, Ended, Observers
from hivenet_router.observability.linewriter import LineWriter
from hivenet_router.pipeline.ticket import Note, Ticket

FIELDS = [
    "log_type",
    "level",
    "trace_id",
    "request_id",
    "tenant_id",
    "key_id",
    "model",
    "status_code",
    "latency_ms",
    "input_tokens",
    "output_tokens",
    "agent_id",
    "error_code",
    "source_ip",
    "ts",
]


def ticket(endpoint: str = "/v1/chat/completions", model: str = "m") -> Ticket:
    t = Ticket("8b9e4a6d-dfb4-4b95-bada-319e7e5b878a", endpoint, 0.0, Observers())
    t.principal = Principal("acme", "k1", "n", frozenset())
    t.facts = RequestFacts(endpoint, model, "llm", False, None)
    t.source_ip = "10.0.0.5"
    return t


def parsed(t: Ticket, event: Ended, now: float = 1_800_000_000.0) -> dict[str, object]:
    line = record(t, event, now)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    value = orjson.loads(line)
    assert isinstance(value, dict)
    return value


def test_a_successful_request_has_every_field_in_the_reference_order() -> None:
    t = ticket()
    t.origin = "12D3KooWpeer"
    entry = parsed(t, Ended(200, None, Outcome.OK, Usage(15, 42), 1.5234))
    assert list(entry) == FIELDS
    assert entry["log_type"] == "audit"
    assert entry["level"] == "info"
    assert entry["trace_id"] == ""
    assert entry["request_id"] == "8b9e4a6d-dfb4-4b95-bada-319e7e5b878a"
    assert (entry["tenant_id"], entry["key_id"], entry["model"]) == ("acme", "k1", "m")
    assert (entry["status_code"], entry["latency_ms"]) == (200, 1523)
    assert (entry["input_tokens"], entry["output_tokens"]) == (15, 42)
    assert (entry["agent_id"], entry["error_code"], entry["source_ip"]) == (
        "12D3KooWpeer",
        "",
        "10.0.0.5",
    )
    started = datetime.fromisoformat(str(entry["ts"]))
    assert started.utcoffset() is not None  # local time, with its offset
    assert abs(started.timestamp() - (1_800_000_000.0 - 1.5234)) < 0.001


def test_error_codes_come_from_the_request_else_from_the_status() -> None:
    t = ticket()
    assert parsed(t, Ended(429, ErrorCode.TOKEN_LIMIT_EXCEEDED, None, None, 0))["error_code"] == (
        "token_limit_exceeded"
    )
    for status, code in [
        (400, "request_invalid"),
        (401, "unauthorized"),
        (404, "model_not_found"),
        (413, "backend_error"),
        (499, "client_closed_request"),
        (503, "no_agents_available"),
        (504, "request_timeout"),
    ]:
        entry = parsed(t, Ended(status, None, None, None, 0))
        assert (entry["error_code"], entry["level"]) == (code, "error")


def test_provider_answers_unauthenticated_and_anonymous_requests() -> None:
    t = ticket()
    t.provider, t.origin = True, "openai"
    assert parsed(t, Ended(200, None, Outcome.OK, None, 0))["agent_id"] == "provider:openai"
    t = ticket()
    t.principal = None  # refused before its identity was known
    entry = parsed(t, Ended(401, ErrorCode.UNAUTHORIZED, None, None, 0))
    assert (entry["tenant_id"], entry["key_id"]) == ("", "")
    t = ticket()
    t.principal = ANONYMOUS
    entry = parsed(t, Ended(200, None, Outcome.OK, None, 0))
    assert (entry["tenant_id"], entry["key_id"]) == ("default", "")


def test_notes_follow_the_reference_fields_in_their_places() -> None:
    # Left as a request leaves them: the replacement mid-request, the charge and the bill
    # when the answer closes; the record's order does not depend on it.
    t = ticket()
    t.note(REPLACED, "degenerate")
    t.note(CHARGED, "0.020")
    t.note(UNBILLED, False)
    t.note(SERVED, "hit")
    line = record(t, Ended(200, None, Outcome.OK, Usage(1, 2), 0), 1_800_000_000.0)
    assert line.endswith(
        b'"cache":"hit","charge":"0.020","billed":false,"replaced":"degenerate"}\n'
    )
    entry = parsed(t, Ended(200, None, Outcome.OK, Usage(1, 2), 0))
    assert list(entry) == [*FIELDS, "cache", "charge", "billed", "replaced"]


def test_a_note_never_replaces_a_reference_field() -> None:
    t = ticket()
    t.note(Note[str]("tenant_id", place=0), "forged")
    entry = parsed(t, Ended(200, None, Outcome.OK, None, 0))
    assert list(entry) == FIELDS and entry["tenant_id"] == "acme"


def test_a_model_name_is_bounded_and_cannot_break_the_line() -> None:
    t = ticket(model="x\n" * 1000)
    entry = parsed(t, Ended(404, ErrorCode.MODEL_NOT_FOUND, None, None, 0))
    assert len(str(entry["model"])) == 256


def test_the_observer_writes_one_line_per_ended_request_and_skips_probes(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    writer = LineWriter(str(path), what="audit", gather=0.001)
    observer = AuditObserver(writer)
    observers = Observers([observer])
    t = ticket()
    t.observers = observers
    t.emit(Admitted())
    t.emit(Ended(200, None, Outcome.OK, Usage(1, 2), 0.01))
    probe = ticket("/health")
    probe.observers = observers
    probe.emit(Ended(200, None, None, None, 0.0))
    writer.close()
    lines = path.read_bytes().splitlines()
    assert len(lines) == 1
    assert orjson.loads(lines[0])["request_id"] == t.request_id
