"""Stages: the steps a request takes between the edge and dispatch, folded once at start.

A stage receives the Ticket and the rest of the pipeline (`next`). It may refuse (raise an
ApiError), hold something (capacity, a reservation) and call `next` at most once. What it
holds it gives back either when `next` fails, or, once an answer exists, in one of that
answer's close hooks, so a stream keeps its hold until its last byte.

The stage list is data: `build` folds it around the terminal (dispatch) once, when the
router starts; a request then runs through plain nested calls.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from hivenet_router.domain.answer import Answer
from hivenet_router.pipeline.ticket import Ticket

Next = Callable[[Ticket], Awaitable[Answer]]


class Stage(Protocol):
    name: str

    async def __call__(self, ticket: Ticket, next: Next) -> Answer: ...


def build(stages: Sequence[Stage], terminal: Next) -> Next:
    """Fold the stages around the terminal: the first stage runs first. Each link is a
    partial application, so a request pays no extra frame per stage."""
    run = terminal
    for stage in reversed(stages):
        run = functools.partial(stage.__call__, next=run)
    return run
