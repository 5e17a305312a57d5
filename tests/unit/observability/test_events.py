"""The observers' fan-out: who is called for which event, and what a failing one does."""

from __future__ import annotations

from hivenet_router.observability.events import Admitted, Ended, Event, Observers
from hivenet_router.pipeline.ticket import Ticket


class Seen:
    """Records the events it is handed; `observes` limits them when given."""

    def __init__(self, observes: frozenset[type] | None = None) -> None:
        if observes is not None:
            self.observes = observes
        self.seen: list[type] = []

    def on_event(self, ticket: Ticket, event: Event) -> None:
        self.seen.append(type(event))

    def on_agent(self, event: object) -> None:
        return None


class Broken(Seen):
    def on_event(self, ticket: Ticket, event: Event) -> None:
        super().on_event(ticket, event)
        raise RuntimeError("observer bug")


def ended() -> Ended:
    return Ended(200, None, None, None, 0.1)


def test_an_observer_that_names_its_events_gets_those_alone() -> None:
    every, only_ended = Seen(), Seen(frozenset({Ended}))
    observers = Observers([every, only_ended])
    ticket = Ticket("r", "/v1/chat/completions", 0.0, observers)
    for event in (Admitted(), ended(), Admitted()):
        ticket.emit(event)
    assert every.seen == [Admitted, Ended, Admitted]
    assert only_ended.seen == [Ended]


def test_replacing_the_observers_replaces_who_is_called() -> None:
    first, second = Seen(), Seen()
    observers = Observers([first])
    ticket = Ticket("r", "/v1/chat/completions", 0.0, observers)
    ticket.emit(Admitted())
    observers.observers = (second,)  # the wiring fills the list after building the edge
    ticket.emit(Admitted())
    assert first.seen == [Admitted]
    assert second.seen == [Admitted]


def test_a_failing_observer_does_not_stop_the_others() -> None:
    broken, after = Broken(), Seen(frozenset({Ended}))
    ticket = Ticket("r", "/v1/chat/completions", 0.0, Observers([broken, after]))
    ticket.emit(ended())
    ticket.emit(ended())
    assert broken.seen == [Ended, Ended]
    assert after.seen == [Ended, Ended]
