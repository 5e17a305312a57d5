"""The cache stage with a stand-in for the rest of the pipeline: off costs nothing, a stored
answer is replayed, identical requests in flight share one call, and what must not be
cached or shared is not."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from hivenet_router.auth.providers import Principal
from hivenet_router.clock import ManualClock
from hivenet_router.domain.answer import Answer, AnswerBroken, Outcome, Whole
from hivenet_router.domain.errors import ApiError, ErrorCode
from hivenet_router.domain.request import Job, RequestFacts
from hivenet_router.gateway.blocks import CACHE
from hivenet_router.gateway.cache import BILLED, SERVED, UNBILLED, ResponseCache
from hivenet_router.gateway.settings import CacheSettings
from hivenet_router.observability.events import Observers
from hivenet_router.pipeline.stage import Next
from hivenet_router.pipeline.ticket import Ticket
from hivenet_router.policy.document import BUILT_IN, Policy

ROUTE = "/v1/chat/completions"
CHUNKS = [b'data: {"id":"a","n":1}\n\n', b'data: {"n":2}\n\n', b"data: [DONE]\n\n"]


class Source:
    def __init__(self, chunks: list[bytes], gate: asyncio.Event | None = None) -> None:
        self.chunks = list(chunks)
        self.gate = gate
        self.closed: list[Outcome] = []

    async def read(self) -> bytes | None:
        if self.gate is not None:
            await self.gate.wait()
        if not self.chunks:
            return None
        chunk = self.chunks.pop(0)
        if chunk == b"BREAK":
            raise AnswerBroken(ErrorCode.BACKEND_ERROR, "engine stopped")
        return chunk

    def close(self, outcome: Outcome) -> None:
        self.closed.append(outcome)


class Engine:
    """The rest of the pipeline: counts calls, answers a stream, may wait or fail."""

    def __init__(self, chunks: list[bytes] | None = None) -> None:
        self.chunks = chunks if chunks is not None else CHUNKS
        self.calls = 0
        self.gate: asyncio.Event | None = None
        self.error: ApiError | None = None
        self.errors: list[ApiError] = []  # raised by the next calls, one each
        self.hold: asyncio.Event | None = None  # the stream waits for it after its first chunk
        self.dispatched = True
        self.sources: list[Source] = []
        self.closes: list[Outcome] = []

    async def __call__(self, ticket: Ticket) -> Answer:
        self.calls += 1
        ticket.dispatched = self.dispatched
        if self.gate is not None:
            await self.gate.wait()
        if self.error is not None:
            raise self.error
        if self.errors:
            raise self.errors.pop(0)
        source = Source(self.chunks[1:], self.hold)
        self.sources.append(source)
        answer = Answer(200, [("Content-Type", "text/event-stream")], source, first=self.chunks[0])
        answer.on_close(lambda outcome, usage: self.closes.append(outcome))
        return answer


def ticket(body: dict[str, Any], tenant: str = "acme", headers: Any = ()) -> Ticket:
    t = Ticket("rid", ROUTE, 0.0, Observers())
    raw = orjson.dumps(body)
    t.facts = RequestFacts(ROUTE, "m", "llm", True, None)
    t.job = Job(ROUTE, "m", "llm", True, raw, list(headers))
    t.principal = Principal(tenant, "k", "k", frozenset())
    t.deadline = asyncio.get_running_loop().time() + 30
    return t


BODY = {"model": "m", "stream": True, "temperature": 0, "messages": [{"role": "user"}]}


DEFAULTS = CacheSettings()


class Cache(ResponseCache):
    """The stage as a request meets it: with the model's policy already on the ticket (the
    handlers resolve it before the first stage)."""

    def __init__(self, policy: Policy, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.policy = policy

    async def __call__(self, ticket: Ticket, next: Next) -> Answer:
        ticket.policy = self.policy
        return await super().__call__(ticket, next)


def stage(settings: CacheSettings | None = DEFAULTS, **kw: Any) -> ResponseCache:
    policy: Policy = BUILT_IN.with_block(CACHE, settings)
    return Cache(policy, ManualClock(), **kw)


async def read(answer: Answer, outcome: Outcome = Outcome.OK) -> bytes:
    out = [answer.first or b""] if answer.body is None else [answer.body]
    while answer.body is None and (chunk := await answer.next_chunk()) is not None:
        out.append(chunk)
    await answer.close(outcome)
    return b"".join(out)


async def test_off_calls_next_and_marks_nothing() -> None:
    cache, engine = stage(None), Engine()
    t = ticket(BODY)
    await read(await cache(t, engine))
    await read(await cache(ticket(BODY), engine))
    assert engine.calls == 2 and t.noted(SERVED) is None and t.get(BILLED)
    assert cache.snapshot().results == {"hit": 0, "miss": 0, "dedup": 0, "bypass": 0}


async def test_a_finished_answer_is_replayed_byte_for_byte() -> None:
    cache, engine = stage(CacheSettings(bill_hits=False)), Engine()
    first = ticket(BODY)
    fresh = await read(await cache(first, engine))
    assert first.noted(SERVED) is None and first.headers_out["X-Hivenet-Cache"] == "miss"
    again = ticket({**BODY, "messages": [{"role": "user"}]})
    replay = await cache(again, engine)
    assert await read(replay) == fresh == b"".join(CHUNKS)
    assert engine.calls == 1 and engine.closes == [Outcome.OK]
    assert again.noted(SERVED) == "hit" and not again.get(BILLED) and again.origin == "cache"
    assert again.noted(UNBILLED) is False and first.noted(UNBILLED) is None
    assert replay.usage is not None or replay.usage is None  # metered like any stream
    snap = cache.snapshot()
    assert snap.entries == 1 and snap.bytes > len(fresh) and snap.results["hit"] == 1


async def test_identical_requests_in_flight_share_one_call() -> None:
    cache, engine = stage(), Engine()
    engine.gate = asyncio.Event()
    tickets = [ticket(BODY) for _ in range(5)]
    pending = [asyncio.ensure_future(cache(t, engine)) for t in tickets]
    for _ in range(5):
        await asyncio.sleep(0)
    assert cache.snapshot().flights == 1
    engine.gate.set()
    answers = await asyncio.gather(*pending)
    streams = await asyncio.gather(*(read(a) for a in answers))
    assert set(streams) == {b"".join(CHUNKS)} and engine.calls == 1
    assert [t.noted(SERVED) for t in tickets] == [None, "dedup", "dedup", "dedup", "dedup"]
    assert tickets[1].get(BILLED) and tickets[1].origin == "cache"
    assert engine.closes == [Outcome.OK] and cache.snapshot().flights == 0


async def test_not_repeatable_and_no_store_pass_through() -> None:
    cache, engine = stage(), Engine()
    hot = {**BODY, "temperature": 0.7}
    for body, headers in ((hot, ()), (BODY, [("cache-control", "no-store")])):
        for _ in range(2):
            t = ticket(body, headers=headers)
            await read(await cache(t, engine))
            assert t.noted(SERVED) is None and "X-Hivenet-Cache" not in t.headers_out
    assert engine.calls == 4 and cache.snapshot().results["bypass"] == 4
    seeded = {**hot, "seed": 1}
    await read(await cache(ticket(seeded), engine))
    await read(await cache(ticket(seeded), engine))
    assert engine.calls == 5  # a seed makes it repeatable


async def test_repeatable_only_off_caches_sampled_answers_too() -> None:
    cache, engine = stage(CacheSettings(repeatable_only=False)), Engine()
    hot = {**BODY, "temperature": 0.7}
    await read(await cache(ticket(hot), engine))
    await read(await cache(ticket(hot), engine))
    assert engine.calls == 1


async def test_no_cache_skips_the_stored_answer_but_refreshes_it() -> None:
    cache, engine = stage(), Engine()
    await read(await cache(ticket(BODY), engine))
    t = ticket(BODY, headers=[("cache-control", "no-cache")])
    await read(await cache(t, engine))
    assert engine.calls == 2 and t.noted(SERVED) is None
    await read(await cache(ticket(BODY), engine))
    assert engine.calls == 2


async def test_tenants_do_not_share_unless_the_policy_says_so() -> None:
    cache, engine = stage(), Engine()
    await read(await cache(ticket(BODY, "acme"), engine))
    await read(await cache(ticket(BODY, "other"), engine))
    assert engine.calls == 2
    shared, engine = stage(CacheSettings(shared=True)), Engine()
    await read(await shared(ticket(BODY, "acme"), engine))
    t = ticket(BODY, "other")
    await read(await shared(t, engine))
    assert engine.calls == 1 and t.noted(SERVED) == "hit"


async def test_errors_are_shared_with_followers_and_never_stored() -> None:
    cache, engine = stage(), Engine()
    engine.gate = asyncio.Event()
    engine.error = ApiError(ErrorCode.BACKEND_ERROR, "engine failed", "backend")
    pending = [asyncio.ensure_future(cache(ticket(BODY), engine)) for _ in range(3)]
    await asyncio.sleep(0)
    engine.gate.set()
    results = await asyncio.gather(*pending, return_exceptions=True)
    assert all(r == engine.error for r in results) and engine.calls == 1
    engine.error = None
    await read(await cache(ticket(BODY), engine))
    assert engine.calls == 2  # nothing was stored


async def test_a_leaders_own_refusal_sends_its_followers_on_alone() -> None:
    cache, engine = stage(), Engine()
    engine.gate = asyncio.Event()
    engine.errors = [ApiError(ErrorCode.RATE_LIMIT_EXCEEDED, "your rate")]
    engine.dispatched = False
    leader = asyncio.ensure_future(cache(ticket(BODY), engine))
    await asyncio.sleep(0)
    follower = asyncio.ensure_future(cache(ticket(BODY), engine))
    await asyncio.sleep(0)
    engine.gate.set()
    with pytest.raises(ApiError):
        await leader
    assert await read(await follower) == b"".join(CHUNKS)
    assert engine.calls == 2


async def test_an_answer_a_stage_marked_unfit_to_serve_again_is_not_stored() -> None:
    cache, engine = stage(), Engine()

    async def judged(t: Ticket) -> Answer:
        answer = await engine(t)
        answer.keep = False  # as the validator marks an answer it judged degenerate at its end
        return answer

    first = await read(await cache(ticket(BODY), judged))
    assert first == b"".join(CHUNKS)  # its client has it whole
    await read(await cache(ticket(BODY), engine))
    assert engine.calls == 2 and cache.snapshot().entries == 1  # the second one stored


async def test_a_broken_stream_is_not_stored() -> None:
    cache, engine = stage(), Engine([CHUNKS[0], b"BREAK"])
    answer = await cache(ticket(BODY), engine)
    with pytest.raises(AnswerBroken):
        await read(answer)
    await answer.close(Outcome.BROKEN)
    engine.chunks = CHUNKS
    await read(await cache(ticket(BODY), engine))
    assert engine.calls == 2 and engine.closes == [Outcome.BROKEN, Outcome.OK]


async def test_a_client_gone_before_the_end_stores_nothing() -> None:
    cache, engine = stage(), Engine()
    engine.hold = asyncio.Event()
    answer = await cache(ticket(BODY), engine)
    await answer.close(Outcome.CLIENT_GONE)
    for _ in range(10):
        await asyncio.sleep(0)
    assert engine.closes == [Outcome.CLIENT_GONE]
    engine.hold = None
    await read(await cache(ticket(BODY), engine))
    assert engine.calls == 2


async def test_an_answer_over_max_entry_bytes_is_served_not_stored() -> None:
    big = [b"data: " + b"x" * 2000 + b"\n\n", b"data: [DONE]\n\n"]
    cache = stage(CacheSettings(max_entry_bytes=1024, max_bytes=4096))
    engine = Engine(big)
    assert await read(await cache(ticket(BODY), engine)) == b"".join(big)
    await read(await cache(ticket(BODY), engine))
    assert engine.calls == 2 and cache.snapshot().entries == 0


async def test_dedup_only_shares_but_stores_nothing() -> None:
    cache, engine = stage(CacheSettings(store=False)), Engine()
    await read(await cache(ticket(BODY), engine))
    await read(await cache(ticket(BODY), engine))
    assert engine.calls == 2 and cache.snapshot().entries == 0


VLLM_ERROR = b'data: {"error":{"message":"CUDA out of memory","code":500}}\n\n'
CUT = b'data: {"choices":[{"delta":{"content":"The answer is"}}]}\n\n'
ANTHROPIC_END = b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
ANTHROPIC_ERROR = (
    b'event: error\ndata: {"type":"error","error":{"type":"overloaded_error","message":"x"}}\n\n'
)
START = b'event: message_start\ndata: {"type":"message_start","message":{}}\n\n'


@pytest.mark.parametrize(
    "chunks",
    [
        [VLLM_ERROR, b"data: [DONE]\n\n"],  # vLLM's failure inside a 200 stream
        [CUT],  # the engine's stream ended before its terminal event
        [START, ANTHROPIC_ERROR],  # Anthropic's error event
        [START, ANTHROPIC_ERROR, ANTHROPIC_END],
    ],
    ids=["vllm-error", "cut", "anthropic-error", "anthropic-error-then-stop"],
)
async def test_an_error_inside_a_200_stream_or_a_cut_stream_is_not_stored(
    chunks: list[bytes],
) -> None:
    cache, engine = stage(), Engine(chunks)
    await read(await cache(ticket(BODY), engine))
    t = ticket(BODY)
    assert await read(await cache(t, engine)) == b"".join(chunks)
    assert engine.calls == 2 and t.noted(SERVED) is None and cache.snapshot().entries == 0


async def test_an_anthropic_stream_that_ends_with_message_stop_is_stored() -> None:
    chunks = [START, b'event: content_block_delta\ndata: {"text":"an error"}\n\n', ANTHROPIC_END]
    cache, engine = stage(), Engine(chunks)
    await read(await cache(ticket(BODY), engine))
    t = ticket(BODY)
    assert await read(await cache(t, engine)) == b"".join(chunks)
    assert engine.calls == 1 and t.noted(SERVED) == "hit"


class WholeEngine:
    def __init__(self, body: bytes) -> None:
        self.body = body
        self.calls = 0

    async def __call__(self, ticket: Ticket) -> Answer:
        self.calls += 1
        ticket.dispatched = True
        return Answer(200, [("content-type", "application/json")], Whole(), body=self.body)


async def test_a_whole_200_body_with_an_error_is_not_stored() -> None:
    whole = {**BODY, "stream": False}
    cache, engine = stage(), WholeEngine(b'{"error":{"message":"overloaded"}}')
    for _ in range(2):
        await read(await cache(ticket(whole), engine))
    assert engine.calls == 2
    engine = WholeEngine(b'{"id":"x","error":null,"choices":[]}')  # no error in it
    for _ in range(2):
        await read(await cache(ticket(whole), engine))
    assert engine.calls == 1


@pytest.mark.parametrize(
    "body",
    [
        b"<html><body>502 Bad Gateway</body></html>",  # a proxy's page under a 200
        b'{"\\u0065rror":{"message":"overloaded"}}',  # an in-band error, its key escaped
        b'{"ok":true}',  # JSON, but no chat completion
    ],
    ids=["html", "escaped-error", "not-a-completion"],
)
async def test_a_whole_200_that_is_not_the_routes_success_is_not_stored(body: bytes) -> None:
    whole = {**BODY, "stream": False}
    cache, engine = stage(), WholeEngine(body)
    for _ in range(2):
        assert await read(await cache(ticket(whole), engine)) == body
    assert engine.calls == 2 and cache.snapshot().entries == 0


async def test_a_stream_with_an_escaped_error_event_is_not_stored() -> None:
    chunks = [b'data: {"\\u0065rror":{"message":"oom"}}\n\n', b"data: [DONE]\n\n"]
    cache, engine = stage(), Engine(chunks)
    for _ in range(2):
        await read(await cache(ticket(BODY), engine))
    assert engine.calls == 2 and cache.snapshot().entries == 0


async def test_a_shared_refusal_carries_retry_after_to_every_follower() -> None:
    cache, engine = stage(), Engine()
    engine.gate = asyncio.Event()

    async def refused(t: Ticket) -> Answer:
        t.dispatched = True
        t.headers_out["Retry-After"] = "7"
        t.headers_out["X-RateLimit-Remaining-Requests"] = "3"  # the leader's own figure
        await engine.gate.wait() if engine.gate else None
        raise ApiError(ErrorCode.QUEUE_FULL, "queue full")

    tickets = [ticket(BODY) for _ in range(3)]
    pending = [asyncio.ensure_future(cache(t, refused)) for t in tickets]
    await asyncio.sleep(0)
    engine.gate.set()
    results = await asyncio.gather(*pending, return_exceptions=True)
    assert all(isinstance(r, ApiError) and r.code is ErrorCode.QUEUE_FULL for r in results)
    for t in tickets[1:]:
        assert t.headers_out.get("Retry-After") == "7"
        assert "X-RateLimit-Remaining-Requests" not in t.headers_out
    # Each says how it got the error: the one that led the call, the ones that shared it.
    assert [t.headers_out.get("X-Hivenet-Cache") for t in tickets] == ["miss", "dedup", "dedup"]


async def test_a_json_body_sent_in_chunks_is_stored_as_a_whole_answer() -> None:
    """A token count asked with "stream": true comes back as JSON in chunks: it is the
    route's success all the same, stored and replayed whole."""
    route = "/v1/messages/count_tokens"
    engine = Engine([b'{"input_tokens"', b":4}"])
    cache = stage()

    async def json_in_chunks(t: Ticket) -> Answer:
        answer = await engine(t)
        answer.headers[:] = [("Content-Type", "application/json")]
        return answer

    def counting() -> Ticket:
        t = ticket(BODY)
        assert t.job is not None
        t.job = Job(route, "m", "llm", True, t.job.body, [])
        t.facts = RequestFacts(route, "m", "llm", True, None)
        return t

    first = counting()
    assert await read(await cache(first, json_in_chunks)) == b'{"input_tokens":4}'
    again = counting()
    answer = await cache(again, json_in_chunks)
    assert answer.body == b'{"input_tokens":4}' and again.headers_out["X-Hivenet-Cache"] == "hit"
    assert engine.calls == 1


async def test_a_follower_is_cut_at_its_own_deadline_not_the_leaders() -> None:
    cache, engine = stage(), Engine()
    engine.hold = asyncio.Event()
    loop = asyncio.get_running_loop()
    leader = ticket(BODY)
    leader.deadline = loop.time() + 0.2
    first = await cache(leader, engine)
    follower = ticket(BODY)
    follower.deadline = loop.time() + 0.35
    second = await cache(follower, engine)
    await asyncio.sleep(0.25)  # the leader's deadline has passed (its relay cuts it)
    await first.close(Outcome.TIMEOUT)
    engine.hold.set()
    assert await read(second) == b"".join(CHUNKS)
    assert engine.closes == [Outcome.OK]


async def test_close_stops_every_flight_and_then_passes_requests_through() -> None:
    cache, engine = stage(), Engine()
    engine.hold = asyncio.Event()
    answer = await cache(ticket(BODY), engine)
    engine.gate = asyncio.Event()
    waiting = asyncio.ensure_future(cache(ticket({**BODY, "seed": 1}), engine))  # before head
    for _ in range(5):
        await asyncio.sleep(0)
    assert cache.snapshot().flights == 2 and engine.calls == 2
    await cache.close()
    assert engine.closes == [Outcome.CLIENT_GONE] and not cache._pumps
    with pytest.raises(AnswerBroken):
        await read(answer)
    with pytest.raises(ApiError) as stopped:
        await waiting  # the engine call it led was cancelled with its pump
    assert stopped.value.code is ErrorCode.BACKEND_UNAVAILABLE
    engine.gate = engine.hold = None
    t = ticket(BODY)
    await read(await cache(t, engine))
    assert engine.calls == 3 and t.noted(SERVED) is None and "X-Hivenet-Cache" not in t.headers_out


async def test_a_leader_that_leaves_hands_the_bill_to_a_follower_that_stays() -> None:
    """With hits unbilled, a first request that leaves before the answer's head (or mid
    stream) must not make the engine call free: the first follower to read it all pays."""
    cache, engine = stage(CacheSettings(bill_hits=False)), Engine()
    engine.gate = asyncio.Event()
    leader, stays, also = ticket(BODY), ticket(BODY), ticket(BODY)
    leading = asyncio.ensure_future(cache(leader, engine))
    following = [asyncio.ensure_future(cache(t, engine)) for t in (stays, also)]
    for _ in range(5):
        await asyncio.sleep(0)
    leading.cancel()  # its client hung up while waiting for the head
    with pytest.raises(asyncio.CancelledError):
        await leading
    engine.gate.set()
    first, second = await asyncio.gather(*following)
    assert not stays.get(BILLED) and not also.get(BILLED)  # hits, so far
    assert await read(first) == b"".join(CHUNKS)
    assert stays.get(BILLED)  # read it all first: the call is its to pay
    assert stays.noted(UNBILLED) is None  # and its audit record says so
    assert await read(second) == b"".join(CHUNKS)
    assert not also.get(BILLED) and engine.calls == 1


async def test_the_first_reader_to_the_end_pays_and_only_it() -> None:
    cache, engine = stage(CacheSettings(bill_hits=False, store=False)), Engine()
    engine.hold = asyncio.Event()
    for leader_first in (True, False):
        leader, follower = ticket(BODY), ticket(BODY)
        first = await cache(leader, engine)
        second = await cache(follower, engine)
        engine.hold.set()
        order = (first, second) if leader_first else (second, first)
        assert await read(order[0]) == await read(order[1])
        assert (leader.get(BILLED), follower.get(BILLED)) == (leader_first, not leader_first)
        engine.hold.clear()


async def test_a_follower_that_finished_pays_when_the_leader_hangs_up_later() -> None:
    cache, engine = stage(CacheSettings(bill_hits=False)), Engine()
    engine.hold = asyncio.Event()
    leader, follower = ticket(BODY), ticket(BODY)
    first = await cache(leader, engine)
    second = await cache(follower, engine)
    engine.hold.set()
    await read(second)
    await first.close(Outcome.CLIENT_GONE)  # pays for what it was sent, as any request
    assert follower.get(BILLED) and leader.get(BILLED)


async def test_a_follower_cut_short_does_not_take_the_bill() -> None:
    cache, engine = stage(CacheSettings(bill_hits=False)), Engine()
    engine.hold = asyncio.Event()
    leader, cut, stays = ticket(BODY), ticket(BODY), ticket(BODY)
    first = await cache(leader, engine)
    answers = [await cache(t, engine) for t in (cut, stays)]
    await first.close(Outcome.CLIENT_GONE)  # the leader's client left mid-stream
    await answers[0].close(Outcome.CLIENT_GONE)
    engine.hold.set()
    await read(answers[1])
    assert not cut.get(BILLED) and stays.get(BILLED)


async def test_a_whole_answer_is_paid_by_whoever_gets_it_first() -> None:
    cache, engine = stage(CacheSettings(bill_hits=False)), WholeEngine(b'{"usage": {}}')
    engine_gate = asyncio.Event()
    leader, follower = ticket(BODY), ticket(BODY)

    async def gated(t: Ticket) -> Answer:
        await engine_gate.wait()
        return await engine(t)

    leading = asyncio.ensure_future(cache(leader, gated))
    for _ in range(3):
        await asyncio.sleep(0)
    following = asyncio.ensure_future(cache(follower, gated))
    for _ in range(3):
        await asyncio.sleep(0)
    leading.cancel()  # gone before the head: it pays nothing
    with pytest.raises(asyncio.CancelledError):
        await leading
    engine_gate.set()
    await read(await following)
    assert follower.get(BILLED) and follower.noted(SERVED) == "dedup"
