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
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from hivenet_router.clock import Clock
from hivenet_router.domain.classify import MESSAGE_LIMIT, message_of, structured_code
from hivenet_router.domain.errors import NON_RETRYABLE, ApiError, ErrorCode
from hivenet_router.policy.document import Policy, Step
from hivenet_router.policy.store import PolicyStore
from hivenet_router.policy.strategies import STRATEGIES
from hivenet_router.router.metrics import RouterMetrics
from hivenet_router.router.providers import Providers
from hivenet_router.router.registry import AgentRecord, Registry
from hivenet_router.router.waitqueue import CapacityQueue, PendingQueue
from hivenet_router.transport.link import INFERENCE_PROTOCOL, LinkClosed, StreamReset

log = logging.getLogger("hivenet.router")

# A whole (non-streamed) answer is held in memory: bound it. Embeddings of a large batch
# are the biggest legitimate answers (2,048 inputs of 3,072 floats are about 60 MB).
MAX_RESPONSE_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Job:
    """One request as dispatch sees it: where to go and the original bytes to carry."""

    route: str
    model: str
    capability: str
    stream: bool
    body: bytes
    headers: list[tuple[str, str]]
    # Gives back what admission reserved in the local pool; called when routing leaves it.
    leave_local: Callable[[], None] = lambda: None


@dataclass(slots=True)
class Progress:
    """Where a request is, so a deadline can say where it expired."""

    phase: str = "queue"


class AnswerSource(Protocol):
    """Where the rest of a streamed answer comes from: an agent stream or a provider."""

    @property
    def finished(self) -> bool: ...

    async def read(self) -> bytes | None: ...

    def reset(self, error: StreamReset | None = None) -> None: ...


@dataclass(slots=True)
class Exchange:
    """An answer. `body` holds a whole buffered answer; `first` a stream's first chunk.
    `agent` is None when the answer came from provider fallback (`provider` names it)."""

    agent: AgentRecord | None
    stream: AnswerSource
    status: int
    headers: list[tuple[str, str]]
    body: bytes | None
    first: bytes | None
    ok: bool = False
    rtt_ms: float | None = None
    provider: str | None = None

    @property
    def client_error(self) -> bool:
        """The engine refused the request itself (a 4xx it would give on any agent)."""
        return 400 <= self.status < 500


class _Done:
    """The source of an answer that arrived whole."""

    finished = True

    async def read(self) -> bytes | None:
        return None

    def reset(self, error: StreamReset | None = None) -> None:
        pass


class _StepExhausted(Exception):
    """The current policy step can do nothing more for this request."""

    def __init__(self, full: bool) -> None:
        super().__init__("step exhausted")
        self.full = full


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
        self,
        registry: Registry,
        metrics: RouterMetrics,
        clock: Clock,
        limits: DispatchLimits,
        policies: PolicyStore,
        providers: Providers | None = None,
    ) -> None:
        self.policies = policies
        self.providers = providers or Providers({})
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

    def claims(self, model: str) -> bool:
        """Does a per-model policy name this model (so provider fallback may serve it)?"""
        return model in self.policies.current.by_model

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
                policy = self.policies.current.for_model(job.model)
                try:
                    exchange = await self._route(job, progress, policy)
                except ApiError as exc:
                    exchange = await self._fall_back(job, policy, exc)
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
            agent = exchange.agent
            if agent is None:
                self.metrics.provider_fallback.labels(
                    job.model, exchange.provider or "", "success" if exchange.ok else "error"
                ).inc()
            elif exchange.ok:
                self._routed(job.model).inc()
                agent.meters.success.inc()
                agent.succeeded(exchange.rtt_ms)
            elif exchange.client_error:
                pass  # the client's mistake: neither a success nor the agent's failure
            else:
                agent.meters.failed.inc()
                agent.failed()
            if agent is not None:
                self._release(agent)
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

    async def _fall_back(self, job: Job, policy: Policy, local: ApiError) -> Exchange:
        """The last resort after every local step: the policy's provider, when it has one,
        the request needs an LLM, the provider serves this route, and its credential was
        configured. Otherwise the local error stands."""
        provider = policy.fallback_provider
        if (
            provider is None
            or job.capability != "llm"
            or not self.providers.supports(provider.engine, job.route)
            or (local.code is ErrorCode.MODEL_NOT_FOUND and job.model not in policy.models)
        ):
            raise local
        log.info(
            "model %s: local steps exhausted (%s); falling back to %s/%s",
            job.model,
            local.code.value,
            provider.engine,
            provider.model,
        )
        job.leave_local()  # the provider does not use the local pool's occupancy
        try:
            answer = await self.providers.forward(
                provider.engine, provider.model, job.route, job.body, job.headers, job.stream
            )
        except ApiError:
            self.metrics.provider_fallback.labels(job.model, provider.engine, "error").inc()
            raise
        source: AnswerSource = answer.stream or _Done()
        return Exchange(
            None,
            source,
            answer.status,
            answer.headers,
            answer.body,
            answer.first,
            provider=provider.engine,
        )

    async def _route(self, job: Job, progress: Progress, policy: Policy) -> Exchange:
        """Walk the policy's steps: the primary step, then each fallback step, each with
        its own try budget and its own set of agents that already failed this request."""
        last: ApiError | None = None
        redialed = False
        full = False
        for index, step in enumerate(policy.steps):
            failed: set[str] = set()
            tries = 0
            budget = step.max_tries or self.limits.max_tries
            while tries < budget:
                progress.phase = "agent"
                try:
                    agent = await self._acquire(job, step, failed)
                except _StepExhausted as exhausted:
                    full = full or exhausted.full
                    break
                agent.meters.utilization.set(agent.load)
                progress.phase = "forward"
                try:
                    exchange = await self._attempt(agent, job)
                except _Retry as retry:
                    agent.meters.failed.inc()
                    agent.failed()
                    self._release(agent)
                    failed.add(agent.peer_id)
                    last = retry.error
                    log.info(
                        "attempt on agent %s failed (step %s): %s",
                        agent.peer_id,
                        step.name,
                        retry.error,
                    )
                    if retry.stale and not redialed:
                        # A stale connection costs no try: the agent redials on its own.
                        redialed = True
                        self.metrics.connection_resets.labels(agent.peer_id).inc()
                        continue
                    tries += 1
                    continue
                except BaseException:
                    self._release(agent)
                    raise
                if index == 0:
                    self.metrics.policy_primary.labels(job.model).inc()
                else:
                    self.metrics.policy_fallback.labels(job.model, step.name).inc()
                return exchange
        self.metrics.policy_exhausted.labels(job.model).inc()
        if not self.registry.for_model(job.model):
            raise ApiError(ErrorCode.MODEL_NOT_FOUND, f"No agents registered for model {job.model}")
        if last is not None:
            # Only the code: the failure's own text names internal addresses and libraries
            # (it is in the log).
            raise ApiError(
                ErrorCode.NO_AGENTS_AVAILABLE,
                f"every policy step of {policy.name} is exhausted; last failure: {last.code.value}",
            )
        if full:
            raise ApiError(
                ErrorCode.NO_CAPACITY, f"All agents for model {job.model} are at maximum capacity"
            )
        raise ApiError(
            ErrorCode.NO_AGENTS_AVAILABLE,
            f"No agent for model {job.model} with capability {job.capability} is connected, "
            f"healthy and allowed by policy {policy.name}",
        )

    def _candidates(self, job: Job, step: Step, failed: set[str]) -> list[AgentRecord] | None:
        """The step's candidates, filtered in the documented order: exact model, health,
        capability, static match, earlier failures in this step, declared capacity, then
        the dynamic gates. An empty list means the step has nobody; None means everybody it
        has is at capacity (worth waiting for)."""
        agents = self.registry.for_model(job.model)
        if not agents:
            raise ApiError(ErrorCode.MODEL_NOT_FOUND, f"No agents registered for model {job.model}")
        pool = [
            agent
            for agent in agents
            if agent.eligible
            and agent.reg.capability == job.capability
            and step.match.accepts(agent)
            and agent.peer_id not in failed
        ]
        if not pool:
            return []
        free = [agent for agent in pool if agent.active < agent.capacity]
        if not free:
            return None
        return [agent for agent in free if step.excluded_by(agent) is None]

    async def _acquire(self, job: Job, step: Step, failed: set[str]) -> AgentRecord:
        """Rank the step's candidates and take a slot on the best one; while every candidate
        is full, wait in the model's FIFO queue. Raises _StepExhausted when the step has no
        candidate, or none frees up and the queue is full or disabled."""
        strategy = STRATEGIES[step.strategy]
        front = False
        waited_from: float | None = None
        while True:
            candidates = self._candidates(job, step, failed)
            if candidates == []:
                raise _StepExhausted(full=False)
            best = strategy.pick(candidates) if candidates else None
            # Pick and take happen in one synchronous step: no other request can take the
            # slot in between.
            if best is not None and best.try_acquire():
                if waited_from is not None:
                    self.metrics.queue_wait.labels(job.model).observe(
                        self.clock.monotonic() - waited_from
                    )
                return best
            queue = self._queue(job.model)
            if self.limits.queue_depth == 0 or (not front and queue.full):
                raise _StepExhausted(full=True)
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
        sent = self.clock.monotonic()
        try:
            stream = await link.open(INFERENCE_PROTOCOL, "POST", job.route, job.headers, job.body)
        except StreamReset as exc:
            if exc.code == "head_too_large":
                # The request itself cannot travel; no agent would do better.
                raise ApiError(
                    ErrorCode.REQUEST_TOO_LARGE, "request headers too large", status=431
                ) from None
            raise _Retry(ApiError(ErrorCode.AGENT_DISCONNECTED, str(exc)), stale=True) from None
        try:
            head = await stream.response_head()
            rtt_ms = (self.clock.monotonic() - sent) * 1000
            if head.status >= 400:
                raw = await stream.read_all(MAX_RESPONSE_BYTES)
                code = structured_code(raw)
                if code in NON_RETRYABLE or (code is None and head.status < 500):
                    return Exchange(
                        agent, stream, head.status, head.headers, raw, None, rtt_ms=rtt_ms
                    )
                raise _Retry(
                    ApiError(code or ErrorCode.BACKEND_ERROR, _message(raw), source="backend")
                )
            if job.stream:
                first = await stream.read()
                return Exchange(
                    agent, stream, head.status, head.headers, None, first, rtt_ms=rtt_ms
                )
            body = await stream.read_all(MAX_RESPONSE_BYTES)
            return Exchange(agent, stream, head.status, head.headers, body, None, rtt_ms=rtt_ms)
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
