"""A Ticket: one request's record from the edge to its last byte.

The edge makes it; stages and dispatch read and fill it; observers receive it with every
event. The class holds only what every request has (its IDs, route, times, caller, facts,
deadline, how it ended) and the one policy snapshot every stage reads. What a stage keeps
for itself, or hands to one other stage, lives under a `Key` its own module declares; what
it wants the audit record to show, it leaves as a `Note`. So a new stage adds a module,
never a field here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Final, Generic, TypeVar, cast

from hivenet_router.domain.agent import Registration
from hivenet_router.domain.answer import Outcome
from hivenet_router.domain.errors import ErrorCode
from hivenet_router.domain.request import Job, RequestFacts, Usage
from hivenet_router.policy.document import BUILT_IN, Policy

if TYPE_CHECKING:
    from hivenet_router.auth.providers import Principal
    from hivenet_router.observability.events import Event, Observers

T = TypeVar("T")
Value = str | int | float | bool  # what a note may hold: a JSON scalar
V = TypeVar("V", bound=Value)
V_co = TypeVar("V_co", bound=Value, covariant=True)
MAX_NOTES: Final = 16  # notes one request keeps; past that a new one is dropped
_ABSENT: Final = object()


class Key(Generic[T]):
    """One stage's state for one request, e.g. `AVOID = Key("avoid", frozenset)`.

    Declared once, at module level, by the stage that owns the state; a stage that reads it
    imports the key from its owner. Keys compare by identity, so two stages cannot collide
    by choosing one name. `default` makes the value of a key nobody put; `get` does not
    store it, so a stage that changes a mutable value puts it back."""

    __slots__ = ("default", "name")

    def __init__(self, name: str, default: Callable[[], T]) -> None:
        self.name = name
        self.default = default

    def __repr__(self) -> str:
        return f"Key({self.name!r})"


class Note(Generic[V_co]):
    """A field a stage leaves for the audit record, e.g. `Note[str]("cache", place=10)`.

    `place` orders the notes after the record's fixed fields (lower first, then in the
    order they were left), so that a record's bytes do not depend on when during the
    request each stage had its say. Each declaration states its place: a new note takes
    one after those in use (search the source for `Note[`)."""

    __slots__ = ("name", "place")

    def __init__(self, name: str, place: int) -> None:
        self.name = name
        self.place = place

    def __repr__(self) -> str:
        return f"Note({self.name!r})"


class Ticket:
    __slots__ = (
        "_notes",
        "_state",
        "admitted",
        "agent",
        "asked_model",
        "deadline",
        "dispatched",
        "endpoint",
        "facts",
        "failure",
        "headers_out",
        "job",
        "method",
        "observers",
        "origin",
        "outcome",
        "phase",
        "policy",
        "principal",
        "provider",
        "request_id",
        "source_ip",
        "started",
        "stream_end",
        "trace_id",
        "usage",
    )

    def __init__(
        self, request_id: str, endpoint: str, started: float, observers: Observers
    ) -> None:
        self.request_id = request_id
        self.endpoint = endpoint  # the route, as metrics label it
        self.started = started  # event-loop time at arrival
        self.observers = observers
        self.method = "GET"  # the HTTP method, one of a fixed few (metrics label it)
        self.source_ip = ""  # the client's address, as the connection gave it
        self.trace_id = ""  # the trace this request belongs to, when tracing is on
        self.principal: Principal | None = None  # who is calling, once the edge knows
        self.facts: RequestFacts | None = None
        # The model a body refused as invalid names (router/handlers.py); facts name it
        # for every other request.
        self.asked_model = ""
        self.job: Job | None = None
        # The model's policy, resolved once when the model is known (before the first
        # stage), so that every stage and dispatch see one version across a reload.
        self.policy: Policy = BUILT_IN
        self.deadline = 0.0  # event-loop time by which the answer's head must be in
        # Event-loop time by which a streamed answer must have ended (--max-stream-duration
        # after arrival); 0: the deadline above.
        self.stream_end = 0.0
        self.phase = "queue"  # where the request is, so a deadline can say where it expired
        self.admitted = False  # admission let it through: it counts for its tenant
        self.dispatched = False  # it reached dispatch: its failures count for its model
        self.origin = ""  # who answered: an agent's peer ID, or a provider's name
        self.provider = False  # the answer came from provider fallback
        self.agent: Registration | None = None  # the agent that answered, as it registered
        # How it ended, for the last event: the error that ended it (also mid-stream),
        # how the answer was closed, and the usage the answer reported.
        self.failure: ErrorCode | None = None
        self.outcome: Outcome | None = None
        self.usage: Usage | None = None
        # Response headers the client gets whatever happens (rate-limit figures).
        self.headers_out: dict[str, str] = {}
        # Made on the first put or note: most requests never need them.
        self._state: dict[object, object] | None = None
        self._notes: dict[Note[Value], Value] | None = None

    @property
    def model(self) -> str:
        return self.facts.model if self.facts is not None else self.asked_model

    @property
    def caller(self) -> Principal:
        """Who is calling, for the parts that run after the edge authenticated the request
        (handlers, stages, dispatch). Observers also see requests refused before that, and
        read `principal`, which is None for them."""
        principal = self.principal
        if principal is None:
            raise RuntimeError(f"request {self.request_id} has no authenticated caller")
        return principal

    def emit(self, event: Event) -> None:
        self.observers.on_event(self, event)

    # -- per-stage state ----------------------------------------------------------------------

    def get(self, key: Key[T]) -> T:
        state = self._state
        if state is not None:
            value = state.get(key, _ABSENT)
            if value is not _ABSENT:
                return cast(T, value)
        return key.default()

    def put(self, key: Key[T], value: T) -> None:
        state = self._state
        if state is None:
            self._state = {key: value}
        else:
            state[key] = value

    # -- notes for the audit record ---------------------------------------------------------

    def note(self, note: Note[V], value: V | None) -> None:
        """Leave `value` under the note's name in the audit record, replacing what this
        note held; None takes it back (the record then has no such field)."""
        notes = self._notes
        if value is None:
            if notes is not None:
                notes.pop(note, None)
            return
        if notes is None:
            self._notes = {note: value}
        elif note in notes or len(notes) < MAX_NOTES:
            notes[note] = value

    def noted(self, note: Note[V]) -> V | None:
        """What the note holds now, or None."""
        notes = self._notes
        return None if notes is None else cast("V | None", notes.get(note))

    def notes(self) -> list[tuple[str, Value]]:
        """The notes as (name, value), in their places."""
        notes = self._notes
        if not notes:
            return []
        ordered = sorted(notes, key=_place) if len(notes) > 1 else list(notes)
        return [(note.name, notes[note]) for note in ordered]


def _place(note: Note[Value]) -> int:
    return note.place
