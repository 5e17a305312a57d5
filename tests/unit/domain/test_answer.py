from __future__ import annotations

import asyncio

import pytest

from hivenet_router.domain.answer import Answer, AnswerBroken, Outcome, Whole
from hivenet_router.domain.errors import ErrorCode
from hivenet_router.domain.request import Usage
from tests.cycles import freed_by_refcount


class Chunks:
    def __init__(self, *chunks: bytes, broken: bool = False) -> None:
        self.chunks = list(chunks)
        self.broken = broken
        self.closed: list[Outcome] = []

    async def read(self) -> bytes | None:
        if self.chunks:
            return self.chunks.pop(0)
        if self.broken:
            raise AnswerBroken(ErrorCode.BACKEND_ERROR, "gone")
        return None

    def close(self, outcome: Outcome) -> None:
        self.closed.append(outcome)


async def test_a_whole_answer_reports_its_usage_once_closed() -> None:
    answer = Answer(
        200,
        [("Content-Type", "application/json")],
        Whole(),
        body=b'{"usage": {"prompt_tokens": 4, "completion_tokens": 2}}',
    )
    seen: list[tuple[Outcome, Usage | None]] = []
    answer.on_close(lambda outcome, usage: seen.append((outcome, usage)))
    assert not answer.streamed and answer.header("content-type") == "application/json"
    await answer.close(Outcome.OK)
    await answer.close(Outcome.BROKEN)  # exactly once
    assert seen == [(Outcome.OK, Usage(4, 2))] and answer.closed


async def test_a_usage_reader_that_fails_still_lets_every_hook_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def unforeseen(body: bytes) -> Usage | None:
        raise ValueError("an answer no reader foresaw")

    monkeypatch.setattr("hivenet_router.domain.answer.from_body", unforeseen)
    answer = Answer(200, [], Whole(), body=b'{"usage": {"prompt_tokens": 4}}')
    seen: list[tuple[Outcome, Usage | None]] = []
    answer.on_close(lambda outcome, usage: seen.append((outcome, usage)))
    await answer.close(Outcome.OK)
    assert seen == [(Outcome.OK, None)] and answer.closed


async def test_an_error_answer_has_no_usage() -> None:
    answer = Answer(400, [], Whole(), body=b'{"usage": {"prompt_tokens": 4}}')
    await answer.close(Outcome.OK)
    assert answer.usage is None


async def test_a_stream_is_metered_as_it_is_read_and_hooks_run_last_first() -> None:
    source = Chunks(
        b'data: {"x": 1}\n\n',
        b'data: {"usage": {"prompt_tokens": 5, "completion_tokens": 7}}\n\ndata: [DONE]\n\n',
    )
    answer = Answer(200, [], source, first=b'data: {"x": 0}\n\n')
    chunks: list[bytes] = []
    answer.on_chunk(chunks.append)
    order: list[str] = []

    async def slow(outcome: Outcome, usage: Usage | None) -> None:
        order.append("first registered")

    answer.on_close(slow)
    answer.on_close(lambda outcome, usage: order.append("last registered"))
    while await answer.next_chunk() is not None:
        pass
    assert len(chunks) == 2
    await answer.close(Outcome.OK)
    assert source.closed == [Outcome.OK]
    assert answer.usage == Usage(5, 7)
    assert order == ["last registered", "first registered"]


async def test_a_failing_hook_does_not_stop_the_others() -> None:
    answer = Answer(200, [], Chunks(), first=b"data: {}\n\n")
    ran: list[str] = []

    def broken(outcome: Outcome, usage: Usage | None) -> None:
        raise RuntimeError("observer bug")

    answer.on_close(lambda outcome, usage: ran.append("release"))
    answer.on_close(broken)
    await answer.close(Outcome.CLIENT_GONE)
    assert ran == ["release"]


async def test_a_broken_source_raises_answer_broken() -> None:
    answer = Answer(200, [], Chunks(b"data: 1\n\n", broken=True), first=b"data: 0\n\n")
    assert await answer.next_chunk() == b"data: 1\n\n"
    with pytest.raises(AnswerBroken) as info:
        await answer.next_chunk()
    assert info.value.code is ErrorCode.BACKEND_ERROR


async def test_closing_drops_the_hooks_so_nothing_waits_for_the_cycle_collector() -> None:
    class Stage:  # holds its answer, as a stage's hold does, and hooks back into it
        def __init__(self, answer: Answer) -> None:
            self.answer = answer
            answer.on_chunk(self.seen)
            answer.on_close(lambda outcome, usage: self.seen(b""))

        def seen(self, chunk: bytes) -> None:
            pass

    with freed_by_refcount("Stage", "Answer", "Chunks"):
        answer = Answer(200, [], Chunks(b"data: 1\n\n"), first=b"data: 0\n\n")
        Stage(answer)
        while await answer.next_chunk() is not None:
            pass
        await answer.close(Outcome.OK)
        del answer


async def test_a_close_cancelled_in_an_async_hook_still_runs_the_earlier_hooks() -> None:
    ran: list[str] = []
    answer = Answer(200, [], Whole(), body=b"{}")
    answer.on_close(lambda outcome, usage: ran.append("slot given back"))  # runs last

    async def settle(outcome: Outcome, usage: Usage | None) -> None:
        await asyncio.sleep(1)  # a settle that waits on a store
        ran.append("settled")

    answer.on_close(settle)
    closing = asyncio.create_task(answer.close(Outcome.OK))
    await asyncio.sleep(0.01)
    closing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closing
    assert ran == ["slot given back"]
