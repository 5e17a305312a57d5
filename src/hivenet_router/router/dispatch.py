"""From an admitted request to an agent's answer: global queue, forwarding slots, agent
selection with atomic slot acquisition, per-model capacity queues, and retries.

`Dispatcher.exchange` is the single owner of everything a request holds on the way: its place
in the global queue, its forwarding slot, its agent slot and its stream. Leaving the context,
by any path, releases each exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from hivenet_router.clock import Clock
from hivenet_router.domain.classify import MESSAGE_LIMIT, message_of, structured_code
from hivenet_router.domain.errors import NON_RETRYABLE, ApiError, ErrorCode
from hivenet_router.router.metrics import RouterMetrics
from hivenet_router.router.registry import AgentRecord, Registry
from hivenet_router.router.waitqueue import CapacityQueue, PendingQueue
from hivenet_router.transport.link import INFERENCE_PROTOCOL, LinkClosed, Stream, StreamReset

log = logging.getLogger("hivenet.router")

MAX_RESPONSE_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Job:
    """One request as dispatch sees it: where to go and the original bytes to carry."""

    route: str
    model: str
    capability: str
    stream: bool
    body: bytes
    headers: list[tuple[str, str]]


@dataclass(slots=True)
class Progress:
    """Where a request is, so a deadline can say where it expired."""

    phase: str = "queue"


@dataclass(slots=True)
class Exchange:
    """An agent's answer. `body` holds a whole buffered answer; `first` a stream's first chunk."""

    agent: AgentRecord
    stream: Stream
    status: int
    headers: list[tuple[str, str]]
    body: bytes | None
    first: bytes | None
    ok: bool = False


class _Retry(Exception):
    def __init__(self, error: ApiError, stale: bool = False) -> None:
        super().__init__(str(error))
        self.error = error
        self.stale = stale


@dataclass(frozen=True, slots=True)
class DispatchLimits:
    queue_size: int
    max_concurrent: int
    enqueue_timeout: float
    queue_depth: int
    max_tries: int


class Dispatcher:
    def __init__(
        self, registry: Registry, metrics: RouterMetrics, clock: Clock, limits: DispatchLimits
    ) -> None:
        self.registry = registry
        self.metrics = metrics
        self.clock = clock
        self.limits = limits
        self.pending = PendingQueue(limits.queue_size, limits.max_concurrent)
        self._queues: dict[str, CapacityQueue] = {}
        self._routed_by_model: dict[str, Any] = {}
        registry.on_join = self._wake_all
        registry.on_slot = self._wake_one

    def _queue(self, model: str) -> CapacityQueue:
        queue = self._queues.get(model)
        if queue is None:
            queue = self._queues[model] = CapacityQueue(self.limits.queue_depth)
        return queue

    def _wake_all(self, model: str) -> None:
        queue = self._queues.get(model)
        if queue is not None:
            queue.wake_all()

    def _wake_one(self, model: str) -> None:
        queue = self._queues.get(model)
        if queue is not None:
            queue.wake_one()

    def queued(self, model: str) -> int:
        queue = self._queues.get(model)
        return len(queue) if queue else 0

    # -- the owner of a request's resources -----------------------------------------------------

    @contextlib.asynccontextmanager
    async def exchange(
        self, job: Job, progress: Progress, deadline: float
    ) -> AsyncIterator[Exchange]:
        """Route `job` and hold its resources while the caller relays the answer.

        `deadline` (event-loop time) bounds everything up to the answer's head; the caller
        bounds the relay itself, since only it can still tell the client what happened.
        """
        progress.phase = "queue"
        pending = self.pending
        forwarding = False
        try:
            # One timer for the whole way to the answer's head.
            async with asyncio.timeout_at(deadline):
                if not await pending.enter(self.limits.enqueue_timeout):
                    raise ApiError(ErrorCode.QUEUE_FULL, "Request queue is full, please retry")
                try:
                    await pending.take_slot()
                    forwarding = True
                finally:
                    self.metrics.global_queue.set(pending.waiting)
                    self.metrics.forwards.set(pending.forwarding)
                exchange = await self._route(job, progress)
        except BaseException:
            if forwarding:
                self._leave_forwarding()
            raise
        try:
            progress.phase = "respond"
            yield exchange
        finally:
            if not exchange.stream.finished:
                exchange.stream.reset(StreamReset("cancelled", "router abandoned the request"))
            meters = exchange.agent.meters
            if exchange.ok:
                self._routed(job.model).inc()
                meters.success.inc()
            else:
                meters.failed.inc()
            self._release(exchange.agent)
            self._leave_forwarding()

    def _leave_forwarding(self) -> None:
        self.pending.release_slot()
        self.metrics.forwards.set(self.pending.forwarding)

    def _routed(self, model: str) -> Any:
        child = self._routed_by_model.get(model)
        if child is None:
            child = self._routed_by_model[model] = self.metrics.routed.labels(model)
        return child

    def _release(self, agent: AgentRecord) -> None:
        self.registry.release(agent)
        agent.meters.utilization.set(agent.load)

    # -- routing with retries -----------------------------------------------------------------

    async def _route(self, job: Job, progress: Progress) -> Exchange:
        failed: set[str] = set()
        tries = 0
        redialed = False
        last: ApiError | None = None
        while True:
            progress.phase = "agent"
            try:
                agent = await self._acquire(job, failed)
            except ApiError as exc:
                if last is None:
                    raise
                raise ApiError(
                    ErrorCode.NO_AGENTS_AVAILABLE,
                    f"no eligible agent left after {tries} failed attempt(s); last failure: {last}",
                ) from exc
            agent.meters.utilization.set(agent.load)
            progress.phase = "forward"
            try:
                return await self._attempt(agent, job)
            except _Retry as retry:
                agent.meters.failed.inc()
                self._release(agent)
                log.info("attempt on agent %s failed: %s", agent.peer_id, retry.error)
                if retry.stale and not redialed:
                    # A stale connection costs no try: the agent redials on its own.
                    redialed = True
                    self.metrics.connection_resets.labels(agent.peer_id).inc()
                    failed.add(agent.peer_id)
                    last = retry.error
                    continue
                failed.add(agent.peer_id)
                tries += 1
                last = retry.error
                if tries >= self.limits.max_tries:
                    raise ApiError(
                        ErrorCode.NO_AGENTS_AVAILABLE,
                        f"all {tries} attempt(s) failed; last failure: {last}",
                    ) from None
            except BaseException:
                self._release(agent)
                raise

    async def _acquire(self, job: Job, failed: set[str]) -> AgentRecord:
        """Pick the least-loaded eligible agent and take one of its slots, waiting in the
        model's FIFO queue while every eligible agent is full."""
        front = False
        waited_from: float | None = None
        while True:
            agents = self.registry.for_model(job.model)
            if not agents:
                raise ApiError(
                    ErrorCode.MODEL_NOT_FOUND, f"No agents registered for model {job.model}"
                )
            best: AgentRecord | None = None
            candidates = 0
            for agent in agents:
                if (
                    not agent.eligible
                    or agent.reg.capability != job.capability
                    or agent.peer_id in failed
                ):
                    continue
                candidates += 1
                if agent.active < agent.capacity and (
                    best is None
                    or (agent.load, agent.last_assigned) < (best.load, best.last_assigned)
                ):
                    best = agent
            if candidates == 0:
                raise ApiError(
                    ErrorCode.NO_AGENTS_AVAILABLE,
                    f"All agents for model {job.model} with capability {job.capability} are "
                    "offline, unhealthy or already failed this request",
                )
            if best is not None and best.try_acquire():
                if waited_from is not None:
                    self.metrics.queue_wait.labels(job.model).observe(
                        self.clock.monotonic() - waited_from
                    )
                return best
            queue = self._queue(job.model)
            if self.limits.queue_depth == 0 or (not front and queue.full):
                raise ApiError(
                    ErrorCode.NO_CAPACITY,
                    f"All agents for model {job.model} are at maximum capacity",
                )
            if waited_from is None:
                waited_from = self.clock.monotonic()
            depth = self.metrics.queue_depth.labels(job.model)
            depth.set(len(queue) + 1)
            try:
                await queue.wait(front=front)
            finally:
                depth.set(len(queue))
            front = True

    async def _attempt(self, agent: AgentRecord, job: Job) -> Exchange:
        link = agent.link
        if link is None or link.closed:
            raise _Retry(
                ApiError(ErrorCode.AGENT_DISCONNECTED, "agent connection is gone"), stale=True
            )
        try:
            stream = await link.open(INFERENCE_PROTOCOL, "POST", job.route, job.headers, job.body)
        except StreamReset as exc:
            raise _Retry(ApiError(ErrorCode.AGENT_DISCONNECTED, str(exc)), stale=True) from None
        try:
            head = await stream.response_head()
            if head.status >= 400:
                raw = await stream.read_all(MAX_RESPONSE_BYTES)
                code = structured_code(raw)
                if code in NON_RETRYABLE or (code is None and head.status < 500):
                    return Exchange(agent, stream, head.status, head.headers, raw, None)
                raise _Retry(
                    ApiError(code or ErrorCode.BACKEND_ERROR, _message(raw), source="backend")
                )
            if job.stream:
                first = await stream.read()
                return Exchange(agent, stream, head.status, head.headers, None, first)
            body = await stream.read_all(MAX_RESPONSE_BYTES)
            return Exchange(agent, stream, head.status, head.headers, body, None)
        except StreamReset as exc:
            stream.reset(exc)
            code = (
                ErrorCode.AGENT_DISCONNECTED
                if isinstance(exc, LinkClosed)
                else ErrorCode.BACKEND_ERROR
            )
            raise _Retry(ApiError(code, f"agent stream failed: {exc}")) from None
        except BaseException:
            stream.reset(StreamReset("cancelled", "request cancelled"))
            raise


def _message(raw: bytes) -> str:
    return message_of(raw)[:MESSAGE_LIMIT]
