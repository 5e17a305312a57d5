"""The response cache and in-flight deduplication stage.

Opt-in per policy (`response_cache`); with none, a request costs one lookup here. For a
cacheable request (repeatable unless the policy says otherwise, and not `no-store`) the
stage answers, in order: from a stored answer (`hit`); from an identical request already
running (`dedup`: it joins that request's flight, here or, with the site store, on another
router); or by leading a flight of its own (`miss`): the rest of the pipeline (admission,
dispatch) runs once for every request that joins it. A hit or a follower never takes
admission capacity nor reaches an engine. Only whole, successful (200) answers read to
their end are stored: never errors (in-band ones included), broken, cut or timed-out
streams, or streams every reader left before the end.

The stage owns tasks (each flight's pump, the site publishers and store writes): `close()`
stops them at shutdown, before the site store's client goes.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import Any, Final

from hivenet_router.clock import Clock
from hivenet_router.domain.answer import Answer, Outcome, Whole
from hivenet_router.domain.errors import ApiError
from hivenet_router.gateway.blocks import CACHE
from hivenet_router.gateway.cache_key import Directives, directives, request_key
from hivenet_router.gateway.cache_store import MemoryStore, Stored, storable
from hivenet_router.gateway.cache_valkey import LeaderLost, SharedCache
from hivenet_router.gateway.flight import SHARED_HEADERS, Flight, Flights, OwnError
from hivenet_router.gateway.settings import CacheSettings
from hivenet_router.observability.cache_metrics import RESULTS, CacheSnapshot
from hivenet_router.pipeline.stage import Next
from hivenet_router.pipeline.ticket import Key, Note, Ticket

ORIGIN: Final = "cache"  # who answered a hit or a follower, as the audit record says
HEADER: Final = "X-Hivenet-Cache"  # hit, dedup or miss, on the response
# The first request waits for its own flight's head a little past its deadline, so that
# dispatch's own timeout (with its phase) is what it reports.
LEADER_GRACE: Final = 1.0
FOLLOW_TRIES: Final = 2  # flights joined whose leader was refused for its own reasons
CLOSE_WAIT: Final = 2.0  # seconds close() gives the pumps, then the site publishers

# Whether this request's answer is billed: not when a cache served it and its policy does not
# bill hits (the wallet stage charges it nothing). The cache decides; the wallet reads it.
BILLED: Final = Key[bool]("bill", lambda: True)
# The audit record's marks: how the cache served it ("hit": a stored answer, "dedup": a
# running identical request's answer), and `billed: false` for an answer not billed.
SERVED: Final = Note[str]("cache", place=10)
UNBILLED: Final = Note[bool]("billed", place=30)


class ResponseCache:
    name = "cache"

    def __init__(self, clock: Clock, valkey: Any = None, prefix: str = "") -> None:
        self.clock = clock
        self.memory = MemoryStore(clock)
        self.flights = Flights()
        # The site store's client (--sync-store=valkey) and key prefix, or in memory only.
        self.shared = SharedCache(valkey, prefix, clock) if valkey is not None else None
        self.results = dict.fromkeys(RESULTS, 0)
        self._pumps: set[asyncio.Task[None]] = set()
        self._closed = False

    async def __call__(self, ticket: Ticket, next: Next) -> Answer:
        settings = ticket.policy.block(CACHE)
        if settings is None or ticket.job is None or self._closed:
            return await next(ticket)
        return await self._cached(ticket, next, settings)

    async def close(self) -> None:
        """Stop every task the stage owns: each flight's pump (its engine call is closed
        as `client_gone`, its readers get an error), then the site publishers (they publish
        the end and release their locks) and store writes, each within CLOSE_WAIT seconds.
        Requests that arrive afterwards pass through uncached."""
        self._closed = True
        pumps = set(self._pumps)
        for pump in pumps:
            pump.cancel()
        if pumps:
            await asyncio.wait(pumps, timeout=CLOSE_WAIT)
        if self.shared is not None:
            await self.shared.close(CLOSE_WAIT)

    def snapshot(self) -> CacheSnapshot:
        return CacheSnapshot(
            results=dict(self.results),
            entries=len(self.memory),
            bytes=self.memory.bytes,
            evictions=self.memory.evictions,
            flights=len(self.flights),
            store_errors=dict(self.shared.errors) if self.shared is not None else {},
        )

    # -- one request --------------------------------------------------------------------------

    async def _cached(self, ticket: Ticket, next: Next, settings: CacheSettings) -> Answer:
        job = ticket.job
        assert job is not None
        want = directives(job.headers)
        tenant = None if settings.shared else ticket.caller.tenant
        key = None
        if not want.no_store:
            key = request_key(job.route, job.model, tenant, job.body, job.headers)
        if key is None or (settings.repeatable_only and not key.repeatable):
            self.results["bypass"] += 1
            return await next(ticket)
        digest = key.digest
        if settings.store and not want.no_cache:
            stored = await self._lookup(digest, want, settings)
            if stored is not None:
                return self._hit(ticket, stored, settings)
        if settings.dedup and not want.no_cache:
            for _ in range(FOLLOW_TRIES):
                flight = self.flights.get(digest)
                if flight is None:
                    break
                try:
                    return await self._follow(ticket, flight, settings)
                except OwnError:
                    continue  # its leader's own refusal: look again, or lead
        return await self._lead(ticket, next, settings, digest, want)

    async def _lookup(
        self, digest: str, want: Directives, settings: CacheSettings
    ) -> Stored | None:
        stored = self.memory.get(digest, want.max_age)
        if stored is not None or self.shared is None:
            return stored
        stored = await self.shared.get(digest)
        if stored is None:
            return None
        age = self.clock.wall() - stored.created
        if want.max_age is not None and age > want.max_age:
            return None
        self.memory.put(
            digest, stored, settings.ttl_seconds, settings.max_entries, settings.max_bytes
        )
        return stored

    def _hit(self, ticket: Ticket, stored: Stored, settings: CacheSettings) -> Answer:
        self._mark(ticket, "hit", settings)
        ticket.headers_out["Age"] = str(max(int(self.clock.wall() - stored.created), 0))
        headers = [("content-type", stored.content_type)] if stored.content_type else []
        if stored.streamed:
            return Answer(stored.status, headers, Whole(), first=stored.data, origin=ORIGIN)
        return Answer(stored.status, headers, Whole(), body=stored.data, origin=ORIGIN)

    async def _follow(self, ticket: Ticket, flight: Flight, settings: CacheSettings) -> Answer:
        # Set before the answer: reading a whole one may already decide that this follower
        # pays for the call (_bill_once).
        _bill(ticket, settings.bill_hits)
        reader = flight.join(deadline=_stream_end(ticket), on_bill=_bill_once(ticket, settings))
        try:
            answer = await reader.answer(ticket.deadline, origin=ORIGIN)
        except ApiError:
            _bill(ticket, True)  # refused, or about to lead a call of its own
            ticket.headers_out.update(flight.refusal_headers)
            ticket.headers_out[HEADER] = "dedup"  # the shared call's failure, shared
            raise
        self._mark(ticket, "dedup", settings, set_bill=False)
        return answer

    def _mark(
        self, ticket: Ticket, result: str, settings: CacheSettings, set_bill: bool = True
    ) -> None:
        self.results[result] += 1
        ticket.note(SERVED, result)
        ticket.origin = ORIGIN
        if set_bill:
            _bill(ticket, settings.bill_hits)
        ticket.headers_out[HEADER] = result

    async def _lead(
        self,
        ticket: Ticket,
        next: Next,
        settings: CacheSettings,
        digest: str,
        want: Directives,
    ) -> Answer:
        """Start a flight (others may join it unless one is running already: a `no-cache`
        request's own) and read it as its first reader."""
        assert ticket.job is not None
        flight = Flight(digest, functools.partial(self._ended, settings, ticket.job.route))
        listed = settings.dedup and self.flights.add(flight)
        opener = functools.partial(self._open, ticket, next, flight, listed, want)
        reader = flight.join(first=True, on_bill=_bill_once(ticket, settings))
        flight.start(opener, _stream_end(ticket), self._pumps)
        try:
            answer = await reader.answer(ticket.deadline + LEADER_GRACE)
        except ApiError:
            ticket.headers_out.update(flight.refusal_headers)  # a remote leader's refusal
            ticket.headers_out[HEADER] = "dedup" if flight.remote else "miss"
            raise
        if flight.remote:
            self._mark(ticket, "dedup", settings)
            answer.origin = ORIGIN
        else:
            self.results["miss"] += 1
            ticket.headers_out[HEADER] = "miss"
        return answer

    async def _open(
        self, ticket: Ticket, next: Next, flight: Flight, listed: bool, want: Directives
    ) -> Answer:
        """The flight's upstream: another router's flight of the same key when the site
        has one running, else the rest of the pipeline."""
        shared = self.shared
        if shared is not None and listed:
            claim = await shared.claim(flight.key)
            if claim is not None:
                nonce, mine = claim
                if mine:
                    shared.publish(flight.key, nonce, flight, ticket.deadline)
                elif not want.no_cache:
                    headers = flight.refusal_headers
                    try:
                        answer = await shared.follow(flight.key, nonce, ticket.deadline, headers)
                    except LeaderLost:
                        pass  # it died or was refused on its own account: go on alone
                    else:
                        flight.remote = True
                        return answer
        try:
            return await next(ticket)
        except Exception as exc:
            if not ticket.dispatched:
                # Refused before dispatch (its rate, its budget): the others are not.
                raise OwnError() from exc
            for name in SHARED_HEADERS:
                if name in ticket.headers_out:
                    flight.refusal_headers[name] = ticket.headers_out[name]
            raise

    def _ended(self, settings: CacheSettings, route: str, flight: Flight, outcome: Outcome) -> None:
        """A flight is over: no one joins it any more; a complete 200 answer is kept."""
        self.flights.discard(flight)
        if not (settings.store and flight.complete and flight.keep and flight.status == 200):
            return
        if flight.size > settings.max_entry_bytes or (flight.body is None and not flight.size):
            return
        content_type = _content_type(flight.headers)
        data = b"".join(flight.chunks) if flight.body is None else flight.body
        assert data is not None
        # A JSON body sent in chunks (a token count asked with "stream": true) is a whole
        # answer, judged and replayed as one; any other chunked answer is a stream.
        streamed = flight.body is None and not _is_json(content_type)
        if not storable(route, streamed, data):
            return  # not the route's success: an error inside a 200, a cut stream, HTML
        stored = Stored(flight.status, content_type, streamed, data, self.clock.wall())
        ttl = settings.ttl_seconds
        self.memory.put(flight.key, stored, ttl, settings.max_entries, settings.max_bytes)
        if self.shared is None or flight.remote:
            return  # a flight of another router: that router stored it in the site store
        if flight.keepers:
            flight.stored = (stored, ttl)  # its publisher writes it before the lock goes
        else:
            self.shared.put(flight.key, stored, ttl)


def _is_json(content_type: str) -> bool:
    return content_type.partition(";")[0].strip().lower() == "application/json"


def _content_type(headers: list[tuple[str, str]]) -> str:
    for name, value in headers:
        if name.lower() == "content-type":
            return value
    return ""


def _bill_once(ticket: Ticket, settings: CacheSettings) -> Callable[[bool], None] | None:
    """With hits unbilled, one request pays for a shared engine call: the first of its
    readers to reach the end of the answer, the leader when it keeps up (as it does unless
    its client is slow or gone). A leader that leaves early pays for what it was sent, as
    any request does, and the follower that reads it all pays for the call; without that,
    asking twice and hanging up the first made the call free."""
    if settings.bill_hits:
        return None  # every reader pays in full anyway
    return functools.partial(_bill, ticket)


def _bill(ticket: Ticket, billed: bool) -> None:
    ticket.put(BILLED, billed)
    ticket.note(UNBILLED, None if billed else False)


def _stream_end(ticket: Ticket) -> float:
    """How long a flight's pump may read the upstream's stream for this request: its
    --max-stream-duration (the head is bounded by the request's deadline elsewhere)."""
    return ticket.stream_end or ticket.deadline
