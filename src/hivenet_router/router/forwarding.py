"""How many requests this router forwards at once, and how many may wait for that.

Fixed by `--max-concurrent` and `--queue-size`, or, by default (0), following the fleet.
A forwarding slot is held from the moment a request leaves the global queue until its
answer's last byte: while it waits in its model's queue for an agent slot, and for as
long as its stream runs. (The Go router gives the slot back at the answer's head, so
its fixed 50 bounds only requests not yet answered; held for whole streams, a fixed 50
left agent slots idle while streams waited in the global queue.) So the cap that never
leaves a declared agent slot idle is what the registered agents can run plus what their
models' queues may hold: the sum of their capacities and `--queue-depth` per model.

Bounds: never below the reference's 50, so providers and a fleet that is still
connecting are served as before; never above `--http-max-conns`, since every forward
serves a client connection, which keeps the memory of streams in flight bounded
(docs/api.md, Limits and queues, gives the measured cost of one).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from hivenet_router.router.registry import AgentRecord, Registry

log = logging.getLogger("hivenet.router")

FLEET_FLOOR = 50  # the reference's --max-concurrent
QUEUE_FLOOR = 100  # the reference's --queue-size
# Registration changes that may change what the fleet can run (a re-registration may
# declare another capacity; health and drains leave the agent registered).
_FLEET_CHANGES = frozenset({"registered", "updated", "unregistered"})


@dataclass(frozen=True, slots=True)
class DispatchLimits:
    queue_size: int  # 0: follows the forwarding limit
    max_concurrent: int  # 0: follows the fleet
    enqueue_timeout: float
    queue_depth: int
    max_tries: int
    ceiling: int = 8192  # most forwards a followed limit allows (--http-max-conns)

    def sizes(self, agents: Iterable[AgentRecord]) -> tuple[int, int]:
        """(global queue size, forwarding limit) with these agents registered."""
        limit = self.max_concurrent
        if not limit:
            models: set[str] = set()
            runnable = 0
            for agent in agents:
                runnable += agent.capacity
                models.add(agent.model)
            runnable += self.queue_depth * len(models)
            limit = max(FLEET_FLOOR, min(runnable, self.ceiling))
        # A fleet twice as large drains a queue twice as long in the same time: the longest
        # wait for a forwarding slot stays about the same as the fleet grows.
        return self.queue_size or max(QUEUE_FLOOR, limit), limit


def follow_fleet(
    registry: Registry, limits: DispatchLimits, resize: Callable[[int, int], None]
) -> None:
    """Call `resize(queue size, forwarding limit)` whenever a registration changes them."""
    current = limits.sizes(registry.all())

    def changed(change: str, record: AgentRecord) -> None:
        nonlocal current
        if change not in _FLEET_CHANGES:
            return
        sizes = limits.sizes(registry.all())
        if sizes != current:
            current = sizes
            resize(*sizes)
            size, limit = sizes
            log.info("forwarding limit now %d, global queue %d (follows the fleet)", limit, size)

    registry.listen(changed)
