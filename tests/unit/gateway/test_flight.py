"""One answer in flight read by many: each reader at its own pace, a reader that leaves
cancels nothing while another reads, the last one out stops the upstream (closed once), and
a failure reaches every reader the same way."""

from __future__ import annotations

import asyncio

import pytest

from hivenet_router.domain.answer import Answer, AnswerBroken, Outcome
from hivenet_router.domain.errors import ApiError, ErrorCode
from hivenet_router.gateway.flight import Flight, Flights, OwnError

Item = bytes | None | BaseException


class Upstream:
    """An engine's stream the test feeds by hand; records how it was closed."""

    def __init__(self) -> None:
        self.items: asyncio.Queue[Item] = asyncio.Queue()
        self.closed: list[Outcome] = []
        self.reads = 0

    async def read(self) -> bytes | None:
        item = await self.items.get()
        self.reads += 1
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self, outcome: Outcome) -> None:
        self.closed.append(outcome)

    def feed(self, *items: Item) -> None:
        for item in items:
            self.items.put_nowait(item)


def started(first: bytes | None = b"c0") -> tuple[Flight, Upstream, list[Outcome]]:
    upstream = Upstream()
    ends: list[Outcome] = []
    flight = Flight("k", lambda f, outcome: ends.append(outcome))

    async def opener() -> Answer:
        return Answer(200, [("content-type", "text/event-stream")], upstream, first=first)

    flight.start(opener, asyncio.get_running_loop().time() + 30, set())
    return flight, upstream, ends


async def read_all(answer: Answer) -> list[bytes]:
    out = [answer.first] if answer.first is not None else []
    while (chunk := await answer.next_chunk()) is not None:
        out.append(chunk)
    await answer.close(Outcome.OK)
    return out


async def settle(predicate: object, rounds: int = 200) -> None:
    for _ in range(rounds):
        if predicate():  # type: ignore[operator]
            return
        await asyncio.sleep(0)
    raise AssertionError("the flight never got there")


def deadline() -> float:
    return asyncio.get_running_loop().time() + 30


async def test_a_slow_reader_does_not_slow_the_others() -> None:
    flight, upstream, _ = started()
    fast = await flight.join(first=True).answer(deadline())
    slow = await flight.join().answer(deadline())
    upstream.feed(b"c1", b"c2", b"c3", None)
    assert await read_all(fast) == [b"c0", b"c1", b"c2", b"c3"]  # slow has read nothing
    await settle(lambda: upstream.closed)
    assert upstream.closed == [Outcome.OK] and flight.complete
    assert await read_all(slow) == [b"c0", b"c1", b"c2", b"c3"]
    assert flight.readers == 0


async def test_a_reader_that_leaves_does_not_cancel_the_others() -> None:
    flight, upstream, _ = started()
    leader = await flight.join(first=True).answer(deadline())
    stays = await flight.join().answer(deadline())
    upstream.feed(b"c1")
    assert await leader.next_chunk() == b"c1"
    await leader.close(Outcome.CLIENT_GONE)
    upstream.feed(b"c2", None)
    assert await read_all(stays) == [b"c0", b"c1", b"c2"]
    await settle(lambda: upstream.closed)
    assert upstream.closed == [Outcome.OK]


async def test_the_last_reader_out_closes_the_upstream_once() -> None:
    flight, upstream, ends = started()
    one = await flight.join(first=True).answer(deadline())
    two = await flight.join().answer(deadline())
    await one.close(Outcome.CLIENT_GONE)
    assert flight.joinable
    await two.close(Outcome.CLIENT_GONE)
    assert not flight.joinable  # stopping: a new identical request starts its own
    await settle(lambda: upstream.closed)
    assert upstream.closed == [Outcome.CLIENT_GONE] and ends == [Outcome.CLIENT_GONE]
    assert not flight.complete


async def test_leaving_before_the_head_cancels_the_upstream_call() -> None:
    gate = asyncio.Event()
    cancelled: list[bool] = []
    flight = Flight("k", lambda f, o: None)

    async def opener() -> Answer:
        try:
            await gate.wait()
        except asyncio.CancelledError:
            cancelled.append(True)
            raise
        raise AssertionError("not reached")

    flight.start(opener, deadline(), set())
    waiting = asyncio.ensure_future(flight.join(first=True).answer(deadline()))
    await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await settle(lambda: cancelled)
    assert flight.readers == 0


async def test_a_refusal_reaches_every_reader() -> None:
    gate = asyncio.Event()
    flight = Flight("k", lambda f, o: None)
    error = ApiError(ErrorCode.BACKEND_ERROR, "engine said no", "backend")

    async def opener() -> Answer:
        await gate.wait()
        raise error

    flight.start(opener, deadline(), set())
    readers = [flight.join(first=True), flight.join(), flight.join()]
    waits = [asyncio.ensure_future(r.answer(deadline())) for r in readers]
    gate.set()
    results = await asyncio.gather(*waits, return_exceptions=True)
    assert results[0] is error  # the first request's own, as raised
    assert results[1] == error == results[2]  # the others: a copy each
    assert results[1] is not error and results[2] is not results[1]
    assert flight.readers == 0


async def test_a_copy_carries_no_other_readers_frames() -> None:
    flight = Flight("k", lambda f, o: None)

    async def opener() -> Answer:
        raise ApiError(ErrorCode.BACKEND_ERROR, "engine said no", "backend")

    flight.start(opener, deadline(), set())
    readers = [flight.join(first=i == 0) for i in range(50)]
    results = await asyncio.gather(*(r.answer(deadline()) for r in readers), return_exceptions=True)
    depths = []
    for result in results[1:]:
        assert isinstance(result, ApiError)
        depth, frame = 0, result.__traceback__
        while frame is not None:
            depth, frame = depth + 1, frame.tb_next
        depths.append(depth)
    assert max(depths) <= 2  # one object re-raised 49 times had grown to 49 frames


async def test_a_refusal_that_is_no_api_error_reaches_readers_as_one() -> None:
    flight = Flight("k", lambda f, o: None)

    async def opener() -> Answer:
        raise AnswerBroken(ErrorCode.BACKEND_UNAVAILABLE, "the other router stopped it")

    flight.start(opener, deadline(), set())
    readers = [flight.join(first=i == 0) for i in range(3)]
    results = await asyncio.gather(*(r.answer(deadline()) for r in readers), return_exceptions=True)
    for result in results:
        assert isinstance(result, ApiError) and result.code is ErrorCode.BACKEND_UNAVAILABLE


async def test_an_own_refusal_stays_with_the_first_reader() -> None:
    flight = Flight("k", lambda f, o: None)
    error = ApiError(ErrorCode.RATE_LIMIT_EXCEEDED, "your rate")

    async def opener() -> Answer:
        await asyncio.sleep(0)
        raise OwnError() from error

    flight.start(opener, deadline(), set())
    first, other = flight.join(first=True), flight.join()
    with pytest.raises(ApiError) as raised:
        await first.answer(deadline())
    assert raised.value is error
    with pytest.raises(OwnError):
        await other.answer(deadline())


async def test_a_break_mid_stream_reaches_every_reader_after_the_same_bytes() -> None:
    flight, upstream, ends = started()
    readers = [await flight.join(first=i == 0).answer(deadline()) for i in range(3)]
    upstream.feed(b"c1", AnswerBroken(ErrorCode.AGENT_DISCONNECTED, "gone"))
    raised: list[AnswerBroken] = []

    async def until_broken(answer: Answer) -> tuple[list[bytes], ErrorCode]:
        got = [answer.first or b""]
        try:
            while (chunk := await answer.next_chunk()) is not None:
                got.append(chunk)
        except AnswerBroken as exc:
            raised.append(exc)
            await answer.close(Outcome.BROKEN)
            return got, exc.code
        raise AssertionError("the stream ended cleanly")

    results = await asyncio.gather(*(until_broken(a) for a in readers))
    assert results == [([b"c0", b"c1"], ErrorCode.AGENT_DISCONNECTED)] * 3
    assert len({id(error) for error in raised}) == 3  # each reader its own
    assert upstream.closed == [Outcome.BROKEN] and ends == [Outcome.BROKEN]


async def test_a_whole_answer_is_shared_as_it_is() -> None:
    flight = Flight("k", lambda f, o: None)
    closed: list[Outcome] = []

    async def opener() -> Answer:
        answer = Answer(200, [], Upstream(), body=b'{"id":"x"}')
        answer.on_close(lambda outcome, usage: closed.append(outcome))
        return answer

    flight.start(opener, deadline(), set())
    answers = [await flight.join(first=i == 0).answer(deadline(), "o") for i in range(2)]
    assert [a.body for a in answers] == [b'{"id":"x"}'] * 2 and answers[1].origin == "o"
    await settle(lambda: closed)
    assert closed == [Outcome.OK] and flight.complete


async def test_waiting_for_the_head_is_bounded_by_the_deadline() -> None:
    flight = Flight("k", lambda f, o: None)
    never = asyncio.Event()

    async def opener() -> Answer:
        await never.wait()
        raise AssertionError("not reached")

    flight.start(opener, deadline(), set())
    keep = flight.join(first=True)
    with pytest.raises(ApiError) as raised:
        await flight.join().answer(asyncio.get_running_loop().time() + 0.01)
    assert raised.value.code is ErrorCode.REQUEST_TIMEOUT
    assert flight.readers == 1
    keep.close(Outcome.CLIENT_GONE)


async def test_the_stream_is_bounded_by_the_deadline() -> None:
    upstream = Upstream()
    flight = Flight("k", lambda f, o: None)

    async def opener() -> Answer:
        return Answer(200, [], upstream, first=b"c0")

    flight.start(opener, asyncio.get_running_loop().time() + 0.02, set())
    answer = await flight.join(first=True).answer(deadline())
    with pytest.raises(AnswerBroken) as raised:
        await answer.next_chunk()
    assert raised.value.code is ErrorCode.REQUEST_TIMEOUT
    await answer.close(Outcome.BROKEN)
    assert upstream.closed == [Outcome.TIMEOUT]


async def test_a_later_reader_extends_the_streams_deadline() -> None:
    upstream = Upstream()
    flight = Flight("k", lambda f, o: None)
    loop = asyncio.get_running_loop()

    async def opener() -> Answer:
        return Answer(200, [], upstream, first=b"c0")

    flight.start(opener, loop.time() + 0.2, set())
    first = await flight.join(first=True).answer(deadline())
    late = await flight.join(deadline=loop.time() + 0.35).answer(deadline())
    await asyncio.sleep(0.25)  # past the first request's deadline
    upstream.feed(b"c1", None)
    assert await read_all(late) == [b"c0", b"c1"]
    assert await read_all(first) == [b"c0", b"c1"]  # its own relay would have cut it
    assert upstream.closed == [Outcome.OK]


async def test_joiners_extend_the_deadline_within_twice_the_first_allowance() -> None:
    flight, _, _ = started()  # its deadline: 30 s from now
    reader = flight.join(first=True)
    start = flight.deadline
    flight.join(deadline=start + 10).close(Outcome.CLIENT_GONE)
    assert flight.deadline == start + 10
    flight.join(deadline=start + 1_000).close(Outcome.CLIENT_GONE)
    assert start + 29 < flight.deadline < start + 31
    flight.join(deadline=start - 5).close(Outcome.CLIENT_GONE)  # never earlier
    assert start + 29 < flight.deadline
    reader.close(Outcome.CLIENT_GONE)
    await settle(lambda: flight.ended)


async def test_flights_by_key_skip_a_flight_that_is_over() -> None:
    flights = Flights()
    flight, upstream, _ = started()
    assert flights.add(flight) and flights.get("k") is flight
    other = Flight("k", lambda f, o: None)
    assert not flights.add(other)
    reader = flight.join(first=True)
    reader.close(Outcome.CLIENT_GONE)  # stopping
    assert flights.get("k") is None and flights.add(other)
    flights.discard(flight)  # not the listed one: kept
    assert flights.get("k") is other and len(flights) == 1
    await settle(lambda: upstream.closed or flight.ended)
