"""The console's memory of recent requests: bounded, paged newest first, the hour's
percentiles, and never the console's own calls."""

from __future__ import annotations

from typing import Any, cast

import orjson

from hivenet_router.console.recent import RECORDS, SAMPLES, RecentRequests, percentiles
from hivenet_router.domain.errors import ApiError, ErrorCode
from hivenet_router.http1.messages import Request
from hivenet_router.observability.audit import ASKED_PATH
from hivenet_router.observability.events import AnswerHead, Ended, Observers
from hivenet_router.pipeline.ticket import Ticket


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


class Asked:
    """What the handlers read of a request: its query."""

    def __init__(self, **query: str) -> None:
        self.query = query


def finish(
    recent: RecentRequests, endpoint: str, seconds: float, status: int = 200, head: bool = True
) -> None:
    ticket = Ticket("r", endpoint, 0.0, Observers())
    if head:
        recent.on_event(ticket, AnswerHead("agent"))
    code = ErrorCode.MODEL_NOT_FOUND if status == 404 else None
    recent.on_event(ticket, Ended(status, code, None, None, seconds))


async def answer(recent: RecentRequests, path: str, **query: str) -> dict[str, Any]:
    handler = recent.requests if path == "requests" else recent.traffic
    response = await handler(cast(Request, Asked(**query)))
    body: dict[str, Any] = orjson.loads(response.body)
    return body


def test_percentiles_of_known_values() -> None:
    values = [n / 1000 for n in range(1, 101)]  # 1 ms to 100 ms
    assert percentiles(values) == {"p50": 50.0, "p90": 90.0, "p99": 99.0}
    assert percentiles([]) == {"p50": None, "p90": None, "p99": None}


async def test_records_are_bounded_and_paged_newest_first() -> None:
    recent = RecentRequests(Clock())
    for _ in range(RECORDS + 5):
        finish(recent, "/v1/chat/completions", 0.01)
    finish(recent, "/admin/health", 0.01)  # an operator's call: not kept
    finish(recent, "/console/", 0.01)
    first = await answer(recent, "requests", limit="3")
    assert [r["seq"] for r in first["requests"]] == [RECORDS + 5, RECORDS + 4, RECORDS + 3]
    assert first["kept"] == RECORDS and first["next_before"] == RECORDS + 3
    last = await answer(recent, "requests", limit="200", before="10")
    assert [r["seq"] for r in last["requests"]] == [9, 8, 7, 6]  # 1 to 5 were dropped
    assert last["next_before"] is None
    assert "messages" not in last["requests"][0] and "prompt" not in last["requests"][0]


async def test_the_hour_keeps_counts_exact_and_samples_bounded() -> None:
    clock = Clock()
    recent = RecentRequests(clock)
    for _ in range(SAMPLES + 10):
        finish(recent, "/v1/chat/completions", 0.02)
    finish(recent, "/v1/chat/completions", 0.5, status=404, head=False)
    traffic = await answer(recent, "traffic")
    assert traffic["requests"] == SAMPLES + 11
    assert traffic["errors_by_code"] == {"model_not_found": 1}
    assert traffic["latency_ms"]["p99"] == 20.0  # the failure's latency is not a sample
    assert len(recent._minutes[-1].latency) == SAMPLES
    clock.now += 61 * 60  # an hour and a minute later: nothing left in the window
    later = await answer(recent, "traffic")
    assert later["requests"] == 0 and later["minutes"] == [] and later["rate_per_second"] == 0.0


async def test_the_rate_is_over_the_last_sixty_seconds_and_idle_minutes_show() -> None:
    """Found by a new user: the rate read the minute under way alone, near zero each time
    a minute began; and the chart had no entry for a minute without requests."""
    clock = Clock()  # 1_800_000_000 is a whole minute
    recent = RecentRequests(clock)
    for _ in range(120):  # a steady 2 a second over a whole minute
        finish(recent, "/v1/chat/completions", 0.01)
    clock.now += 61  # one second into the next minute, nothing yet
    traffic = await answer(recent, "traffic")
    assert traffic["rate_per_second"] == round(120 * 59 / 60 / 60, 3)
    clock.now += 120  # two idle minutes later, one request
    finish(recent, "/v1/chat/completions", 0.01)
    minutes = (await answer(recent, "traffic"))["minutes"]
    assert [m["requests"] for m in minutes] == [120, 0, 0, 1]
    assert [m["start"] for m in minutes] == [1_800_000_000 + 60 * i for i in range(4)]


async def test_only_ascii_whole_numbers_page() -> None:
    recent = RecentRequests(Clock())
    for raw in ("\u00b2", "\u0661\u0662", "\uff11", "9" * 5000, "-1", "0"):
        try:
            await answer(recent, "requests", limit=raw)
        except ApiError as exc:
            assert exc.code is ErrorCode.REQUEST_INVALID
        else:
            raise AssertionError(f"limit={raw[:10]!r} was taken")


async def test_an_admin_path_of_no_route_is_not_traffic() -> None:
    recent = RecentRequests(Clock())
    ticket = Ticket("r", "unmatched", 0.0, Observers())
    ticket.note(ASKED_PATH, "/admin/wallets/acme")
    recent.on_event(ticket, Ended(404, ErrorCode.NOT_FOUND, None, None, 0.01))
    other = Ticket("r", "unmatched", 0.0, Observers())
    other.note(ASKED_PATH, "/v2/chat")
    recent.on_event(other, Ended(404, ErrorCode.NOT_FOUND, None, None, 0.01))
    assert [r["path"] for r in (await answer(recent, "requests"))["requests"]] == ["/v2/chat"]
