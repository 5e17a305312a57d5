"""The request log line: its fields in both formats, quoting, and its level switch."""

from __future__ import annotations

import logging

import orjson
import pytest

from hivenet_router.auth.providers import Principal
from hivenet_router.domain.answer import Outcome
from hivenet_router.domain.errors import ErrorCode
from hivenet_router.domain.request import RequestFacts
from hivenet_router.observability.audit import ASKED_METHOD, ASKED_PATH
from hivenet_router.observability.events import Ended, Observers
from hivenet_router.observability.linewriter import LineWriter
from hivenet_router.observability.requestlog import LOGGER, RequestLog
from hivenet_router.pipeline.ticket import Ticket


def ticket(model: str = "m") -> Ticket:
    t = Ticket("rid-1", "/v1/chat/completions", 0.0, Observers())
    t.principal = Principal("acme", "k1", "n", frozenset())
    t.facts = RequestFacts("/v1/chat/completions", model, "llm", False, None)
    t.origin, t.trace_id, t.source_ip = "peer-1", "4bf92f3577b34da6a3ce929d0e0e4736", "::1"
    return t


def test_text_lines_carry_the_correlation_fields() -> None:
    log = RequestLog(LineWriter("-", what="test"), "text")
    line = log.line(ticket(), Ended(200, None, Outcome.OK, None, 0.0123), 1_800_000_000.0)
    text = line.decode()
    assert text.endswith("\n") and text.count("\n") == 1
    assert f"INFO {LOGGER}: " in text
    for part in (
        "request_id=rid-1",
        "trace_id=4bf92f3577b34da6a3ce929d0e0e4736",
        "endpoint=/v1/chat/completions",
        "status=200",
        'error_code=""',
        "duration_ms=12.3",
        "tenant=acme",
        "model=m",
        "peer_id=peer-1",
        "source_ip=::1",
    ):
        assert part in text


def test_a_hostile_model_name_is_quoted_and_cannot_forge_a_field() -> None:
    log = RequestLog(LineWriter("-", what="test"), "text")
    line = log.line(ticket('a b\nstatus=200 "x'), Ended(404, None, None, None, 0), 0.0)
    text = line.decode()
    assert text.count("\n") == 1
    assert 'model="a b\\nstatus=200 \\"x"' in text


def test_json_lines_and_levels() -> None:
    log = RequestLog(LineWriter("-", what="test"), "json")
    entry = orjson.loads(log.line(ticket(), Ended(502, None, None, None, 0.5), 0.0))
    assert (entry["logger"], entry["level"], entry["msg"]) == (LOGGER, "warning", "request")
    assert (entry["status"], entry["error_code"], entry["request_id"]) == (
        502,
        "backend_error",
        "rid-1",
    )


def test_the_access_logger_level_turns_it_off(capfd: pytest.CaptureFixture[str]) -> None:
    writer = LineWriter("stderr", what="test", gather=0.001)
    observer = RequestLog(writer, "text")
    t = ticket()
    logger = logging.getLogger(LOGGER)
    before = logger.level
    try:
        logger.setLevel(logging.WARNING)
        observer.on_event(t, Ended(200, None, Outcome.OK, None, 0))
        logger.setLevel(logging.INFO)
        observer.on_event(t, Ended(201, None, Outcome.OK, None, 0))
    finally:
        logger.setLevel(before)
    writer.close()
    err = capfd.readouterr().err
    assert "status=201" in err
    assert "status=200" not in err


def test_a_request_for_no_route_carries_its_method_and_path_quoted() -> None:
    t = Ticket("rid-2", "unmatched", 0.0, Observers())
    t.note(ASKED_METHOD, "GET")
    t.note(ASKED_PATH, "/v1/x y\nstatus=200")
    ended = Ended(404, ErrorCode.NOT_FOUND, None, None, 0.0)
    text = RequestLog(LineWriter("-", what="test"), "text").line(t, ended, 0.0).decode()
    assert text.count("\n") == 1
    assert text.endswith(' method=GET path="/v1/x y\\nstatus=200"\n')
    entry = orjson.loads(RequestLog(LineWriter("-", what="test"), "json").line(t, ended, 0.0))
    assert (entry["endpoint"], entry["method"], entry["path"]) == (
        "unmatched",
        "GET",
        "/v1/x y\nstatus=200",
    )
    assert "path" not in orjson.loads(
        RequestLog(LineWriter("-", what="test"), "json").line(ticket(), ended, 0.0)
    )
