"""The state a second router will need to share, behind small async ports.

Admission decides with these and nothing else, so the in-process implementations here
(state/local.py) can be replaced by shared ones (several routers of a site, through
Valkey) without touching a gate:

- a `Counter` counts what a key spends per window: requests or tokens per minute (a
  bucket that refills continuously) or tokens per UTC day. `charge` checks and takes in
  one atomic step;
- a `Pool` holds work in flight (token-weighted occupancy); `reserve` returns a `Lease`,
  which has one owner, grows with streamed output, and is released exactly once.

`Ports` bundles the six a router hands admission: in-process ones (router/wiring.py) or a
site's (sync/site.py), which is why it lives here and not beside admission.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import TracebackType
from typing import Protocol


@dataclass(frozen=True, slots=True)
class Verdict:
    ok: bool
    remaining: int | None = None  # what is left of a finite limit, after this charge


class Counter(Protocol):
    """Spend per key and window. `limit` travels with every call: a key's limit can change
    (a reload, a new replica) and 0 means unlimited."""

    async def charge(self, key: str, amount: float, limit: float) -> Verdict:
        """Take `amount` if it fits under `limit`; refuse whole otherwise."""
        ...

    async def adjust(self, key: str, delta: float, limit: float) -> None:
        """Correct what was spent (exact usage after an estimate; a refund is negative).
        Never goes below nothing spent, nor, for rates, beyond one window of debt."""
        ...

    async def left(self, key: str, limit: float) -> float:
        """What could still be charged now."""
        ...


class Budget(Counter, Protocol):
    """A daily budget: a Counter that also learns when a charge is closed, so that what a
    site shares can tell settled usage from work still in flight."""

    async def settle(self, key: str, charged: float, spent: float) -> None:
        """A request charged `charged` at admission ended having used `spent` (0 when
        nothing was answered, `charged` when the exact usage is unknown)."""
        ...


class Lease(Protocol):
    """One reservation in a pool. Release it in every case: `async with` does."""

    @property
    def amount(self) -> int: ...

    def grow(self, delta: int) -> None:
        """Change the reserved amount (streamed output; exact input replacing an estimate)."""
        ...

    def release(self) -> None:
        """Give the reservation back; a second call does nothing."""
        ...

    async def __aenter__(self) -> Lease: ...

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None: ...


class Pool(Protocol):
    """Work in flight per key (a model, or a key and a model)."""

    async def reserve(
        self, key: str, amount: int, budget: int, wait: float, most: int = 0
    ) -> Lease | None:
        """Reserve `amount` against `budget` (0: no token budget) and at most `most`
        reservations (0: no count limit), waiting up to `wait` seconds in line for room.
        None when it did not fit in time."""
        ...


@dataclass(frozen=True, slots=True)
class Ports:
    """Where admission keeps its counts."""

    rates: Counter  # requests per minute, per owner (or owner and model)
    daily: Budget  # tokens per UTC day, per budget key
    input_rates: Counter  # serverless input tokens per minute, per key and model
    output_rates: Counter  # serverless output tokens per minute, per key and model
    occupancy: Pool  # B2: token-weighted work in flight per model
    shares: Pool  # B4: each key's share of it, per key and model
