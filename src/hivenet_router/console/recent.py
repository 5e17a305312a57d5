"""What the console's Traffic view reads: the latest requests (their audit records, bounded
and paged) and the last hour of traffic (rate, errors by code, TTFT and latency
percentiles), both kept in memory by one observer.

The records are the audit records (observability/audit.py) the router writes, kept here
whether or not --audit-log-path writes them anywhere: they never hold a prompt, an answer,
a header or a credential (`key_id` is the key's registry ID, not the key). At most RECORDS
are kept; the hour is kept as one bucket a minute with at most SAMPLES latencies each, so
memory stays bounded whatever the traffic.
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Final

import orjson

from hivenet_router.domain.errors import ApiError, ErrorCode
from hivenet_router.http1.messages import Answer, Request, Response
from hivenet_router.observability.audit import ASKED_PATH, SKIPPED, error_code, record
from hivenet_router.observability.events import AgentEvent, AnswerHead, Ended, Event
from hivenet_router.pipeline.ticket import Key, Ticket

Handler = Callable[[Request], Awaitable[Answer]]

RECORDS = 1000  # audit records kept for GET /admin/requests
PAGE, MAX_PAGE = 50, 200  # records a page by default, and at most
MINUTES = 60  # buckets of the traffic history
SAMPLES = 1000  # latencies kept a minute (the first ones; the counts are exact)
PERCENTILES = (50, 90, 99)
OWN = ("/admin", "/console")  # operators' calls and the console's files: not kept
UNMATCHED: Final = "unmatched"  # the endpoint of a request for no route (audit.py)
_WHOLE_NUMBER: Final = re.compile(r"[0-9]{1,19}")
# When the answer's head came, event-loop time: the time to first token is head - started.
FIRST_BYTE: Final = Key[float]("console_first_byte", lambda: 0.0)


@dataclass(slots=True)
class Minute:
    start: int  # Unix minute (seconds // 60)
    requests: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    # (tenant, code) of refused requests: bounded by the tenants of the keys and the codes
    refusals: Counter[tuple[str, str]] = field(default_factory=Counter)
    latency: list[float] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)


def percentiles(values: list[float]) -> dict[str, float | None]:
    ordered = sorted(values)
    out: dict[str, float | None] = {}
    for p in PERCENTILES:
        if not ordered:
            out[f"p{p}"] = None
            continue
        # nearest rank: the smallest value with at least p% of the values at or below it
        index = min(len(ordered) - 1, max(0, math.ceil(p * len(ordered) / 100) - 1))
        out[f"p{p}"] = round(ordered[index] * 1000, 1)
    return out


class RecentRequests:
    """An observer of finished requests, and the admin routes that read what it kept."""

    observes = frozenset({AnswerHead, Ended})

    def __init__(self, wall: Callable[[], float] = time.time) -> None:
        self._wall = wall
        self._loop_time = asyncio.get_running_loop().time
        self._records: deque[tuple[int, bytes]] = deque(maxlen=RECORDS)
        self._seq = 0
        self._minutes: deque[Minute] = deque(maxlen=MINUTES)

    # -- the observer ---------------------------------------------------------------------

    def on_event(self, ticket: Ticket, event: Event) -> None:
        if type(event) is AnswerHead:
            if not ticket.get(FIRST_BYTE):
                ticket.put(FIRST_BYTE, self._loop_time())
            return
        endpoint = ticket.endpoint
        if type(event) is not Ended or endpoint in SKIPPED or endpoint.startswith(OWN):
            return  # the console's own polling would hide the traffic it is there to show
        if endpoint == UNMATCHED and str(ticket.noted(ASKED_PATH) or "").startswith(OWN):
            return  # an admin or console path of no route (the console's own, at times)
        now = self._wall()
        self._seq += 1
        self._records.append((self._seq, record(ticket, event, now)))
        minute = self._minute(int(now // 60))
        minute.requests += 1
        code = error_code(event)
        if code:
            minute.errors[code] += 1
            principal = ticket.principal
            if principal is not None and principal.tenant:
                minute.refusals[(principal.tenant, code)] += 1
        elif len(minute.latency) < SAMPLES:
            minute.latency.append(event.seconds)
            head = ticket.get(FIRST_BYTE)
            if head:
                minute.ttft.append(max(0.0, head - ticket.started))

    def on_agent(self, event: AgentEvent) -> None:
        return None

    def _minute(self, start: int) -> Minute:
        minutes = self._minutes
        if not minutes or minutes[-1].start != start:
            minutes.append(Minute(start))
        return minutes[-1]

    # -- the admin routes -----------------------------------------------------------------

    def routes(self) -> list[tuple[str, str, Handler]]:
        return [
            ("GET", "/admin/requests", self.requests),
            ("GET", "/admin/traffic", self.traffic),
        ]

    async def requests(self, request: Request) -> Response:
        """The latest audit records, newest first: `?limit=` (1 to 200, 50 by default) and
        `?before=` (a `seq` from the last page) to read older ones."""
        limit = _number(request.query.get("limit"), "limit", PAGE, 1, MAX_PAGE)
        before = _number(request.query.get("before"), "before", self._seq + 1, 1, 2**62)
        page: list[dict[str, Any]] = []
        for seq, line in reversed(self._records):
            if seq >= before:
                continue
            if len(page) == limit:
                break
            page.append({"seq": seq, **orjson.loads(line)})
        more = bool(page) and page[-1]["seq"] > self._records[0][0]
        body = {
            "requests": page,
            "next_before": page[-1]["seq"] if more else None,
            "kept": len(self._records),
            "limit": RECORDS,
        }
        return Response(orjson.dumps(body))

    async def traffic(self, request: Request) -> Response:
        """The last hour, a bucket a minute, and its totals."""
        now = int(self._wall() // 60)
        minutes = [m for m in self._minutes if now - m.start < MINUTES]
        errors: Counter[str] = Counter()
        refusals: dict[str, Counter[str]] = {}
        latency: list[float] = []
        ttft: list[float] = []
        for m in minutes:
            errors.update(m.errors)
            for (tenant, code), count in m.refusals.items():
                refusals.setdefault(tenant, Counter())[code] += count
            latency.extend(m.latency)
            ttft.extend(m.ttft)
        body = {
            "window_seconds": MINUTES * 60,
            "requests": sum(m.requests for m in minutes),
            "rate_per_second": round(self._rate(minutes), 3),
            "errors_by_code": dict(errors.most_common()),
            "errors_by_tenant": {
                tenant: dict(codes.most_common()) for tenant, codes in sorted(refusals.items())
            },
            "latency_ms": percentiles(latency),
            "ttft_ms": percentiles(ttft),
            "minutes": _timeline(minutes, now),
        }
        return Response(orjson.dumps(body))

    def _rate(self, minutes: list[Minute]) -> float:
        """Requests a second over the last 60 seconds: the minute under way, and the part
        of the one before that the window still covers (the minute under way alone read
        near zero each time a minute began)."""
        now = self._wall()
        current = int(now // 60)
        into = now - current * 60
        count = 0.0
        for m in minutes[-2:]:
            if m.start == current:
                count += m.requests
            elif m.start == current - 1:
                count += m.requests * (60 - into) / 60
        return count / 60


def _timeline(minutes: list[Minute], now: int) -> list[dict[str, int]]:
    """One entry a minute from the first kept to the current one, a minute without
    requests included (a chart of the entries is then a timeline)."""
    if not minutes:
        return []
    kept = {m.start: m for m in minutes}
    out = []
    for start in range(minutes[0].start, now + 1):
        m = kept.get(start)
        out.append(
            {
                "start": start * 60,
                "requests": m.requests if m else 0,
                "errors": sum(m.errors.values()) if m else 0,
            }
        )
    return out


def _number(raw: str | None, name: str, default: int, low: int, high: int) -> int:
    if raw is None:
        return default
    # ASCII digits only: str.isdigit takes "²" (which int() refuses) and other scripts'.
    if _WHOLE_NUMBER.fullmatch(raw) is None or not low <= int(raw) <= high:
        raise ApiError(ErrorCode.REQUEST_INVALID, f"{name}: an integer from {low} to {high}")
    return int(raw)
