"""What happens to a request (and to an agent), as events for observers.

Handlers, stages and dispatch say what happened by emitting an event on the request's
Ticket; observers (metrics today; audit records and traces next) read them and never
change anything. One fan-out calls every observer in turn, and an observer that raises is
logged, never allowed to break a request.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from hivenet_router.domain.answer import Outcome
from hivenet_router.domain.errors import ErrorCode
from hivenet_router.domain.request import Usage

if TYPE_CHECKING:
    from hivenet_router.pipeline.ticket import Ticket

log = logging.getLogger("hivenet.router")


@dataclass(frozen=True, slots=True)
class Admitted:
    """Admission let the request through (after every gate that applied)."""


@dataclass(frozen=True, slots=True)
class Refused:
    """A gate refused the request: `reason` is the gate (`b1`, `b2`, `b4_itpm`, `rpm`...)."""

    reason: str
    code: ErrorCode


@dataclass(frozen=True, slots=True)
class Queued:
    """The request waited `seconds` for an agent slot, and got one."""

    seconds: float


@dataclass(frozen=True, slots=True)
class Attempt:
    """One forward to an agent ended before an answer: `code` says why; `stale` when the
    agent's connection was found gone before anything was sent; `seconds` it took."""

    agent: str
    code: ErrorCode
    stale: bool = False
    seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class AnswerHead:
    """An answer's head arrived: from an agent (`step` of the policy, 0 the primary) or, for
    provider fallback, from `provider`."""

    origin: str
    step: int = 0
    step_name: str = ""
    provider: bool = False
    seconds: float = 0.0  # from sending the request to its answer's head


@dataclass(frozen=True, slots=True)
class Exhausted:
    """Every step of the policy was tried for this request without an answer."""


@dataclass(frozen=True, slots=True)
class Ended:
    """The request is over: its status, the error code (None when it succeeded), how the
    answer ended (None when there was none), and the usage it reported."""

    status: int
    code: ErrorCode | None
    outcome: Outcome | None
    usage: Usage | None
    seconds: float


Event = Admitted | Refused | Queued | Attempt | AnswerHead | Exhausted | Ended


@dataclass(frozen=True, slots=True)
class AgentEvent:
    """Something happened to an agent: `disconnected` (its connection dropped, or it fell
    silent and was removed), `unhealthy` (missed heartbeats), `backend_down` (it reported
    its engine unhealthy)."""

    kind: str
    peer_id: str
    model: str


class RequestObserver(Protocol):
    """An observer may also have `observes`: the event classes it reads. The fan-out then
    calls it for those alone (three or four events pass per request, and most observers
    read one of them); without it, the observer gets every event."""

    def on_event(self, ticket: Ticket, event: Event) -> None: ...

    def on_agent(self, event: AgentEvent) -> None: ...


class Observers:
    """The fan-out: every observer that reads an event, in order, each shielded from the
    others."""

    def __init__(self, observers: Sequence[RequestObserver] = ()) -> None:
        self.observers = tuple(observers)

    @property
    def observers(self) -> tuple[RequestObserver, ...]:
        return self._observers

    @observers.setter
    def observers(self, observers: tuple[RequestObserver, ...]) -> None:
        self._observers = observers
        self._by_kind: dict[type, tuple[RequestObserver, ...]] = {}

    def _readers(self, kind: type) -> tuple[RequestObserver, ...]:
        readers = tuple(
            observer
            for observer in self._observers
            if (wanted := getattr(observer, "observes", None)) is None or kind in wanted
        )
        self._by_kind[kind] = readers
        return readers

    def on_event(self, ticket: Ticket, event: Event) -> None:
        kind = type(event)
        readers = self._by_kind.get(kind)
        if readers is None:
            readers = self._readers(kind)
        for observer in readers:
            try:
                observer.on_event(ticket, event)
            except Exception:
                log.exception("observer %s failed on %s", type(observer).__name__, event)

    def on_agent(self, event: AgentEvent) -> None:
        for observer in self.observers:
            try:
                observer.on_agent(event)
            except Exception:
                log.exception("observer %s failed on %s", type(observer).__name__, event)
