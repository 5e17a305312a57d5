"""A Ticket: one request's record from the edge to its last byte.

The edge makes it; stages and dispatch read and fill it; observers receive it with every
event. It is the per-request scratch object plug-ins and stages share, so that none of them
needs to know the others.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from hivenet_router.domain.agent import Registration
from hivenet_router.domain.answer import Outcome
from hivenet_router.domain.errors import ErrorCode
from hivenet_router.domain.request import Job, RequestFacts, Usage
from hivenet_router.policy.document import BUILT_IN, Policy

if TYPE_CHECKING:
    from hivenet_router.observability.events import Event, Observers


def _nothing() -> None:
    return None


class Ticket:
    __slots__ = (
        "admitted",
        "agent",
        "avoid",
        "bill",
        "cache",
        "charge",
        "deadline",
        "dispatched",
        "endpoint",
        "facts",
        "failure",
        "headers_out",
        "job",
        "leave_pool",
        "method",
        "observers",
        "origin",
        "outcome",
        "phase",
        "policy",
        "principal",
        "provider",
        "replaced",
        "request_id",
        "source_ip",
        "started",
        "trace",
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
        self.trace: Any = None  # the tracer's own record of the request's spans
        self.principal: Any = None  # who is calling (auth.providers.Principal)
        self.facts: RequestFacts | None = None
        self.job: Job | None = None
        # The model's policy, resolved once when the model is known (before the first
        # stage), so that every stage and dispatch see one version across a reload.
        self.policy: Policy = BUILT_IN
        self.deadline = 0.0  # event-loop time by which the whole request must be done
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
        # Called when routing leaves the local pool (provider fallback): stages that hold
        # local capacity give it back early.
        self.leave_pool: Callable[[], None] = _nothing
        # Gateway stages. How a cache served it: "" (it did not), "hit" (a stored answer)
        # or "dedup" (a running identical request's answer); whether its wallet is charged;
        # what was charged (a Decimal, once settled); why its local answer was replaced
        # ("degenerate": the stream validator sent it elsewhere); agents dispatch skips
        # (peer IDs that already failed this request).
        self.cache = ""
        self.bill = True
        self.charge: Any = None
        self.replaced = ""
        self.avoid: frozenset[str] = frozenset()

    @property
    def model(self) -> str:
        return self.facts.model if self.facts is not None else ""

    def emit(self, event: Event) -> None:
        self.observers.on_event(self, event)
