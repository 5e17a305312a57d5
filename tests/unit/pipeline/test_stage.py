"""The pipeline: stages folded once around a terminal, each holding what it takes until
the answer it passes on is closed."""

from __future__ import annotations

import pytest

from hivenet_router.domain.answer import Answer, Outcome, Whole
from hivenet_router.domain.errors import ApiError, ErrorCode
from hivenet_router.observability.events import Observers
from hivenet_router.pipeline.stage import Next, build
from hivenet_router.pipeline.ticket import Ticket


class Holding:
    """A stage that takes something and gives it back when the answer closes."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name = name
        self.log = log
        self.held = 0

    async def __call__(self, ticket: Ticket, next: Next) -> Answer:
        self.log.append(f"{self.name} in")
        self.held += 1
        try:
            answer = await next(ticket)
        except BaseException:
            self.held -= 1
            raise
        answer.on_close(lambda outcome, usage: self._give_back())
        self.log.append(f"{self.name} out")
        return answer

    def _give_back(self) -> None:
        self.held -= 1
        self.log.append(f"{self.name} released")


def ticket() -> Ticket:
    return Ticket("rid", "/v1/chat/completions", 0.0, Observers())


async def test_stages_run_in_order_and_release_when_the_answer_closes() -> None:
    log: list[str] = []
    outer, inner = Holding("outer", log), Holding("inner", log)

    async def terminal(t: Ticket) -> Answer:
        log.append("terminal")
        return Answer(200, [], Whole(), first=b"data: {}\n\n")

    run = build([outer, inner], terminal)
    answer = await run(ticket())
    assert log == ["outer in", "inner in", "terminal", "inner out", "outer out"]
    assert (outer.held, inner.held) == (1, 1)  # a stream keeps its hold until it is closed
    await answer.close(Outcome.OK)
    assert (outer.held, inner.held) == (0, 0)
    assert log[-2:] == ["outer released", "inner released"]


async def test_a_refusal_gives_back_what_earlier_stages_took() -> None:
    log: list[str] = []
    outer = Holding("outer", log)

    async def refusing(t: Ticket) -> Answer:
        raise ApiError(ErrorCode.NO_CAPACITY, "full")

    with pytest.raises(ApiError):
        await build([outer], refusing)(ticket())
    assert outer.held == 0


async def test_no_stages_is_the_terminal_alone() -> None:
    async def terminal(t: Ticket) -> Answer:
        return Answer(204, [], Whole(), body=b"")

    assert (await build([], terminal)(ticket())).status == 204
