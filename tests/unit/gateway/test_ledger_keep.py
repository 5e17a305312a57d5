"""Calls gathered per loop turn: a caller that goes away has what it asked for given back
once, and only after its batch was answered."""

from __future__ import annotations

import asyncio

import pytest

from hivenet_router.gateway.ledger_keep import TurnGather


class Batches:
    """A `send` that answers "held" to each call once let through, noting what it saw."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.sent: list[str] = []
        self.abandoned: list[tuple[str, int]] = []  # (arg, batches answered by then)
        self.answered = 0
        self.before_answer: list[asyncio.Task[str]] = []  # cancelled as the answer comes
        self.cut = False  # the batch is cancelled (a shutdown) instead of answered

    async def send(self, batch: list[str]) -> list[str | Exception]:
        await self.gate.wait()
        if self.cut:
            raise asyncio.CancelledError
        self.sent.extend(batch)
        loop = asyncio.get_running_loop()
        for caller in self.before_answer:
            loop.call_soon(caller.cancel)  # runs after the answers are set, before any reader
        self.answered += 1
        return ["held"] * len(batch)

    def gather(self) -> TurnGather[str]:
        return TurnGather(
            self.send, abandoned=lambda arg: self.abandoned.append((arg, self.answered))
        )


async def test_a_caller_gone_mid_batch_is_given_back_after_the_answer() -> None:
    batches = Batches()
    gather = batches.gather()
    staying = asyncio.create_task(gather("a"))
    leaving = asyncio.create_task(gather("b"))
    await asyncio.sleep(0.01)
    leaving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await leaving
    assert batches.abandoned == []  # not before the batch is answered
    batches.gate.set()
    assert await staying == "held"
    assert batches.sent == ["a", "b"] and batches.abandoned == [("b", 1)]


async def test_a_caller_cancelled_as_its_answer_arrives_is_given_back_once() -> None:
    batches = Batches()
    gather = batches.gather()
    caller = asyncio.create_task(gather("a"))
    batches.before_answer.append(caller)
    await asyncio.sleep(0.01)
    batches.gate.set()
    with pytest.raises(asyncio.CancelledError):
        await caller
    await asyncio.sleep(0.01)
    assert batches.abandoned == [("a", 1)]


async def test_a_cut_batch_gives_back_every_call_and_wait_sees_it_end() -> None:
    batches = Batches()
    gather = batches.gather()
    callers = [asyncio.create_task(gather(name)) for name in ("a", "b")]
    await asyncio.sleep(0.01)
    batches.cut = True
    batches.gate.set()
    for caller in callers:
        with pytest.raises(asyncio.CancelledError):
            await caller
    await gather.wait(1.0)
    assert sorted(arg for arg, _ in batches.abandoned) == ["a", "b"]


async def test_wait_returns_once_the_batches_in_flight_are_answered() -> None:
    batches = Batches()
    gather = batches.gather()
    caller = asyncio.create_task(gather("a"))
    await asyncio.sleep(0.01)
    await gather.wait(0.05)  # bounded while the batch is held
    assert not caller.done()
    batches.gate.set()
    await gather.wait(1.0)
    assert caller.done() and caller.result() == "held"
