"""The pipeline's terminal: from an admitted request to an answer's head (global queue,
forwarding slots, atomic agent slots, per-model queues, retries over the policy's steps,
provider fallback). Everything taken on the way is given back when dispatch fails or when
the answer it returns is closed, so a stream holds its slots until its last byte. The
transport's StreamReset stops here: above this layer a broken answer is an AnswerBroken.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Iterator
from typing import Final

from hivenet_router.clock import Clock
from hivenet_router.domain.answer import Answer, Closer, Outcome
from hivenet_router.domain.classify import MESSAGE_LIMIT, message_of, structured_code
from hivenet_router.domain.errors import NON_RETRYABLE, ApiError, ErrorCode
from hivenet_router.domain.metering import asking_for_usage, expect_usage, native_provider
from hivenet_router.domain.request import Job, Usage
from hivenet_router.domain.usage import USAGE_ENGINES
from hivenet_router.expiry import Deadlines
from hivenet_router.gateway.validator import AVOID
from hivenet_router.observability.events import AnswerHead, Attempt, Exhausted, Queued
from hivenet_router.pipeline.ticket import Key, Ticket
from hivenet_router.policy.document import Policy, Provider, Step
from hivenet_router.policy.executor import run_step
from hivenet_router.policy.plugins import RouteInput
from hivenet_router.policy.signals import AgentFacts
from hivenet_router.policy.store import PolicyStore
from hivenet_router.router.agent_source import AgentSource
from hivenet_router.router.forwarding import DispatchLimits, follow_fleet
from hivenet_router.router.providers import ProviderRefused, Providers
from hivenet_router.router.registry import AgentRecord, Registry
from hivenet_router.router.routing_state import RoutingState, Sent, header_value, queue_cost
from hivenet_router.router.waitqueue import CapacityQueue, PendingQueue, Place
from hivenet_router.transport.link import INFERENCE_PROTOCOL, LinkClosed, Stream, StreamReset

log = logging.getLogger("hivenet.router")

# A whole (non-streamed) answer is held in memory: bound it. Embeddings of a large batch
# are the biggest legitimate answers (2,048 inputs of 3,072 floats are about 60 MB).
MAX_RESPONSE_BYTES = 64 * 1024 * 1024

_TIMEOUT_MESSAGES = {
    "queue": "Request expired in queue",
    "agent": "Request timed out waiting for an available agent",
    "forward": "Request deadline exceeded while contacting agent",
    "provider": "Request deadline exceeded while contacting provider",
}


def _stay() -> None:
    return None


# What gives back the local capacity a request holds when routing leaves the local pool
# (provider fallback): a stage that holds some puts its release here.
LEAVE_POOL: Final = Key[Callable[[], None]]("leave_pool", lambda: _stay)


class _Retry(Exception):
    """This attempt failed in a way another agent might not."""

    def __init__(self, error: ApiError, stale: bool = False) -> None:
        super().__init__(str(error))
        self.error = error
        self.stale = stale


class Dispatcher:
    """The terminal of the request pipeline."""

    name = "dispatch"

    def __init__(
        self,
        registry: Registry,
        clock: Clock,
        limits: DispatchLimits,
        policies: PolicyStore,
        providers: Providers | None = None,
        routing: RoutingState | None = None,
    ) -> None:
        self.policies = policies
        self.providers = providers or Providers({})
        self.registry = registry
        self.routing = routing or RoutingState(clock, registry)
        self.clock = clock
        self.limits = limits
        self.pending = PendingQueue(*limits.sizes(registry.all()))
        if not limits.max_concurrent:
            follow_fleet(registry, limits, self.pending.resize)
        self.deadlines = Deadlines()  # each request's, on one timer per 50 ms
        self._queues: dict[str, CapacityQueue] = {}
        # Per model, when (on self.clock) an open breaker lets probes in, and the timer that
        # wakes the model's waiters then.
        self._probe_timers: dict[str, tuple[float, asyncio.Handle]] = {}
        registry.watch(self._wake_all)

    def claims(self, model: str) -> bool:
        """Does a per-model policy name this model (so provider fallback may serve it)?"""
        return model in self.policies.current.by_model

    def queued(self, model: str) -> int:
        queue = self._queues.get(model)
        return len(queue) if queue else 0

    def waiting(self) -> Iterator[tuple[str, int]]:
        """(model, requests waiting for an agent slot), for gauges read at scrape time."""
        for model, queue in list(self._queues.items()):
            yield model, len(queue)

    def _queue(self, model: str) -> CapacityQueue:
        queue = self._queues.get(model)
        if queue is None:
            queue = self._queues[model] = CapacityQueue(self.limits.queue_depth)
        return queue

    def _wake_all(self, model: str) -> None:
        queue = self._queues.get(model)
        if queue is not None:
            queue.wake_all()

    def _wake_at_probe(self, model: str, delay: float) -> None:
        """Wake `model`'s waiters in `delay` seconds, when an open breaker of one of their
        agents lets a probe through. Nothing else would: no slot frees when a breaker turns
        half-open, and with every other agent busy on long answers the waiters would sleep
        until their deadline beside an agent they may use. One timer per model, the
        earliest asked for."""
        due = self.clock.monotonic() + delay
        pending = self._probe_timers.get(model)
        if pending is not None:
            if pending[0] <= due:
                return
            pending[1].cancel()
        # Late by a little rather than early: uvloop counts timers in whole milliseconds, and
        # a wake-up before the breaker lets probes in would only send every waiter back to
        # sleep (and set the timer again).
        handle = asyncio.get_running_loop().call_later(delay + 0.002, self._probe_due, model)
        self._probe_timers[model] = (due, handle)

    def _probe_due(self, model: str) -> None:
        del self._probe_timers[model]
        self._wake_all(model)

    # -- the terminal ---------------------------------------------------------------------

    async def __call__(self, ticket: Ticket) -> Answer:
        """Queue, take a forwarding slot, route (retrying over the policy's steps, then the
        provider), and return the answer's head. Bounded by the ticket's deadline."""
        job = ticket.job
        assert job is not None
        ticket.dispatched = True
        ticket.phase = "queue"
        pending = self.pending
        forwarding = False
        try:
            try:
                with self.deadlines.start(ticket.deadline):
                    if not await pending.enter(self.limits.enqueue_timeout):
                        raise ApiError(ErrorCode.QUEUE_FULL, "Request queue is full, please retry")
                    await pending.take_slot()
                    forwarding = True
                    policy = ticket.policy
                    try:
                        answer = await self._route(ticket, job, policy)
                    except ApiError as exc:
                        answer = await self._fall_back(ticket, job, policy, exc)
            except TimeoutError:
                message = _TIMEOUT_MESSAGES.get(ticket.phase, "Request timeout")
                raise ApiError(ErrorCode.REQUEST_TIMEOUT, message) from None
        except BaseException:
            if forwarding:
                pending.release_slot()
            raise
        answer.on_close(lambda outcome, usage: pending.release_slot())
        ticket.phase = "respond"
        return answer

    # -- routing with retries -----------------------------------------------------------------

    async def _route(self, ticket: Ticket, job: Job, policy: Policy) -> Answer:
        """Walk the policy's steps: the primary step, then each fallback step, each with
        its own try budget and its own set of agents that already failed this request."""
        last: ApiError | None = None
        redialed = False
        full = False
        routing = self.routing
        header = _session_header(policy)
        inp = routing.input(ticket, policy, header)
        for index, step in enumerate(policy.steps):
            keyed = _step_header(step)
            if keyed is not None and keyed != header:
                # A later step may key its sessions on a header of its own.
                header = keyed
                inp.session = header_value(job.headers, header)
            avoid = ticket.get(AVOID)
            failed = set(avoid)
            tries = 0
            budget = step.max_tries or self.limits.max_tries
            while tries < budget:
                ticket.phase = "agent"
                agent, step_full = await self._acquire(ticket, step, failed, inp, policy)
                full = full or step_full
                if agent is None:
                    break
                routed = Sent()
                try:
                    # Still in the synchronous step that took the slot.
                    routed = routing.chosen(inp, step, agent, policy)
                    ticket.phase = "forward"
                    sent = self.clock.monotonic()
                    answer = await self._attempt(ticket, job, agent, policy, routed)
                except _Retry as retry:
                    routing.settled(agent, policy, False, None, None, job.stream, routed)
                    self._release(agent)
                    failed.add(agent.peer_id)
                    last = retry.error
                    ticket.emit(
                        Attempt(
                            agent.peer_id,
                            retry.error.code,
                            retry.stale,
                            self.clock.monotonic() - sent,
                        )
                    )
                    log.info(
                        "attempt on agent %s failed (step %s): %s",
                        agent.peer_id,
                        step.name,
                        retry.error,
                    )
                    if retry.stale and not redialed:
                        # A stale connection costs no try: the agent redials on its own.
                        redialed = True
                        continue
                    tries += 1
                    continue
                except BaseException:
                    routing.cut_short(agent, policy, self._blame(ticket), routed)
                    self._release(agent)
                    raise
                ticket.origin, ticket.agent = agent.peer_id, agent.reg
                ticket.emit(
                    AnswerHead(
                        agent.peer_id, index, step.name, seconds=self.clock.monotonic() - sent
                    )
                )
                return answer
        ticket.emit(Exhausted())
        raise self._exhausted(ticket, job, policy, last, full)

    def _blame(self, ticket: Ticket) -> bool | None:
        """How an attempt cut short before its answer's head counts: a failure of the agent
        (or provider) when the request's deadline ran out waiting for it, neither when the
        client went away or the router is stopping. The deadline is on the event loop's
        clock, whose timers enforce it: read that clock, not another one beside it (under
        uvloop the loop's clock is its own, in whole milliseconds; in tests both are the
        injected ManualClock, clock.VirtualTimeLoop)."""
        return False if asyncio.get_running_loop().time() >= ticket.deadline else None

    def _exhausted(
        self, ticket: Ticket, job: Job, policy: Policy, last: ApiError | None, full: bool
    ) -> ApiError:
        agents = self.registry.for_model(job.model)
        if not agents:
            return ApiError(
                ErrorCode.MODEL_NOT_FOUND, f"No agents registered for model {job.model}"
            )
        if all(a.reg.capability != job.capability for a in agents):
            # Not a passing state: no agent of the model does this kind of request at all.
            # A 400 the SDKs do not retry, where a 503 had them try three more times.
            kinds = ", ".join(sorted({a.reg.capability for a in agents}))
            return ApiError(
                ErrorCode.INVALID_PARAMETER,
                f"model {job.model} is served for {kinds} requests, not {job.capability} "
                f"(an agent declares what its engine does with --capability)",
                param="model",
            )
        wait = self.routing.all_open(policy, [a for a in agents if a.eligible])
        if wait is not None and not full:
            # Every healthy agent is being given time to recover: say when to come back.
            ticket.headers_out["Retry-After"] = str(max(1, math.ceil(wait)))
            return ApiError(
                ErrorCode.NO_AGENTS_AVAILABLE,
                f"every agent for model {job.model} has its circuit breaker open after "
                "repeated failures; retry later",
            )
        if last is not None:
            # Only the code: the failure's own text names internal addresses and libraries
            # (it is in the log).
            return ApiError(
                ErrorCode.NO_AGENTS_AVAILABLE,
                f"every policy step of {policy.name} is exhausted; last failure: {last.code.value}",
            )
        if full:
            return ApiError(
                ErrorCode.NO_CAPACITY, f"All agents for model {job.model} are at maximum capacity"
            )
        return ApiError(
            ErrorCode.NO_AGENTS_AVAILABLE,
            f"No agent for model {job.model} with capability {job.capability} is connected, "
            f"healthy and allowed by policy {policy.name}",
        )

    async def _acquire(
        self, ticket: Ticket, step: Step, failed: set[str], inp: RouteInput, policy: Policy
    ) -> tuple[AgentRecord | None, bool]:
        """Take a slot on the step's best candidate; while every candidate is full, wait in
        the model's queue, where tenants take turns by their share of tokens. (None, full)
        when the step can do nothing more: full says its candidates were all busy and the
        queue was full or disabled."""
        model = inp.facts.model
        place: Place | None = None  # in the model's queue, from the first time all were full
        waited_from = 0.0
        while True:
            agents = self._agents_for(model)
            admits = self.routing.prepare(inp, policy, agents)
            choice = run_step(step, inp, agents, failed, admits)
            # Choice and take happen in one synchronous step: no other request can take
            # the slot in between.
            if choice.agent is not None and choice.agent.try_acquire():
                if place is not None:
                    self._queue(model).served(place)
                    ticket.emit(Queued(self.clock.monotonic() - waited_from))
                return choice.agent, False
            if not choice.full:
                if place is not None:
                    # Woken for a slot this step can no longer use (its candidates were
                    # drained, fell ill or are excluded now): pass the wake-up on.
                    self._queue(model).wake_one()
                return None, False
            if place is None:
                _turn_away(agents)
            queue = self._queue(model)
            if self.limits.queue_depth == 0 or (place is None and queue.full):
                return None, True
            self._before_waiting(queue, inp, policy, agents, admits)
            if place is None:
                waited_from = self.clock.monotonic()
                place = self._place(queue, ticket)
            await queue.wait(place)

    def _agents_for(self, model: str) -> list[AgentRecord]:
        agents = self.registry.for_model(model)
        if not agents:
            raise ApiError(ErrorCode.MODEL_NOT_FOUND, f"No agents registered for model {model}")
        return agents

    def _before_waiting(
        self,
        queue: CapacityQueue,
        inp: RouteInput,
        policy: Policy,
        agents: list[AgentRecord],
        admits: Callable[[AgentFacts], bool],
    ) -> None:
        """Before a request sleeps in the queue, make sure something will wake it or the
        others: a free slot it cannot use, or a breaker that will let probes in."""
        facts = inp.facts
        if any(
            a.eligible and a.active < a.limit and a.reg.capability == facts.capability and admits(a)
            for a in agents
        ):
            # A free slot this request cannot use (an agent it failed on or avoids, or
            # one its step's match or gates leave out): the others look again, or one
            # that could use it would sleep until the next release. Not for an agent
            # nobody here can use (another capability, its breaker open): that would
            # wake the whole queue at every release while it idles.
            queue.pass_on()
        probe = self.routing.next_probe(
            policy,
            (a for a in agents if a.eligible and a.reg.capability == facts.capability),
        )
        if probe is not None:
            self._wake_at_probe(facts.model, probe)

    @staticmethod
    def _place(queue: CapacityQueue, ticket: Ticket) -> Place:
        """The request's place in the model's queue: its tenant's turn, weighted by the
        tenant's share and the request's estimated tokens."""
        caller = ticket.caller
        return queue.place(caller.tenant, caller.quota.queue_weight, queue_cost(ticket))

    def _release(self, agent: AgentRecord) -> None:
        self.registry.release(agent)
        queue = self._queues.get(agent.model)
        if queue is not None:
            # One wake-up per slot now free: settling may have raised the agent's limit
            # (adaptive concurrency, a reload without it) so that more than this one freed.
            free = agent.limit - agent.active if agent.eligible else 1
            for _ in range(max(1, min(free, len(queue)))):
                queue.slot_freed()

    async def _attempt(
        self, ticket: Ticket, job: Job, agent: AgentRecord, policy: Policy, routed: Sent
    ) -> Answer:
        link = agent.link
        if link is None or link.closed:
            raise _Retry(
                ApiError(ErrorCode.AGENT_DISCONNECTED, "agent connection is gone"), stale=True
            )
        sent = self.clock.monotonic()
        body = asking_for_usage(job, agent.reg.engine in USAGE_ENGINES)
        headers = routed.forwarded(job.headers)  # with the prompt's prefix blocks
        try:
            stream = await link.open(
                INFERENCE_PROTOCOL, "POST", job.route, headers, body or job.body
            )
        except StreamReset as exc:
            if exc.code == "head_too_large":
                # The request itself cannot travel; no agent would do better.
                raise ApiError(
                    ErrorCode.REQUEST_TOO_LARGE, "request headers too large", status=431
                ) from None
            raise _Retry(ApiError(ErrorCode.AGENT_DISCONNECTED, str(exc)), stale=True) from None
        try:
            answer = await self._answer(stream, job, agent.peer_id)
            expect_usage(answer, job, agent.reg.engine in USAGE_ENGINES)
        except StreamReset as exc:
            stream.reset(exc)
            if exc.code == "too_large":
                # The agent cannot take a body this large; no other agent would either.
                raise ApiError(
                    ErrorCode.REQUEST_TOO_LARGE, "request body too large for the agent", status=413
                ) from None
            code = (
                ErrorCode.AGENT_DISCONNECTED
                if isinstance(exc, LinkClosed)
                else ErrorCode.BACKEND_ERROR
            )
            raise _Retry(ApiError(code, f"agent stream failed: {exc}")) from None
        except BaseException:
            stream.reset(StreamReset("cancelled", "request cancelled"))
            raise
        rtt_ms = (self.clock.monotonic() - sent) * 1000
        answer.on_close(self._settle(agent, answer, rtt_ms, policy, routed))
        return answer

    @staticmethod
    async def _answer(stream: Stream, job: Job, peer: str) -> Answer:
        """Read an agent's answer head (and whole body, unless it streams)."""
        head = await stream.response_head()
        source = AgentSource(stream, peer)
        if head.status >= 400:
            raw = await stream.read_all(MAX_RESPONSE_BYTES)
            code = structured_code(raw)
            if code in NON_RETRYABLE or (code is None and head.status < 500):
                return Answer(head.status, head.headers, source, body=raw, origin=peer)
            raise _Retry(ApiError(code or ErrorCode.BACKEND_ERROR, _message(raw), "backend"))
        if job.stream:
            first = await stream.read()
            return Answer(head.status, head.headers, source, first=first, origin=peer)
        body = await stream.read_all(MAX_RESPONSE_BYTES)
        return Answer(head.status, head.headers, source, body=body, origin=peer)

    def _settle(
        self, agent: AgentRecord, answer: Answer, rtt_ms: float, policy: Policy, routed: Sent
    ) -> Closer:
        """When the answer closes: the agent's statistics and what routing learns, then its
        slot back."""
        stream = answer.streamed

        def settle(outcome: Outcome, usage: Usage | None) -> None:
            ok: bool | None
            if outcome is Outcome.CLIENT_GONE or (outcome is Outcome.OK and answer.status >= 400):
                # The client's doing, or an error the engine judged final for this request
                # (retryable ones never reach here): neither a success nor a failure.
                ok = None
            else:
                ok = outcome is Outcome.OK
            self.routing.settled(agent, policy, ok, rtt_ms, usage, stream, routed)
            self._release(agent)

        return settle

    # -- the last resort ------------------------------------------------------------------------

    async def _fall_back(self, ticket: Ticket, job: Job, policy: Policy, local: ApiError) -> Answer:
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
        routing = self.routing
        if not routing.provider_allows(provider.engine, policy):
            log.warning(
                "model %s: provider %s skipped, its circuit breaker is open",
                job.model,
                provider.engine,
            )
            raise local
        log.info(
            "model %s: local steps exhausted (%s); falling back to %s/%s",
            job.model,
            local.code.value,
            provider.engine,
            provider.model,
        )
        return await self._provider_answer(ticket, job, policy, provider)

    async def to_provider(self, ticket: Ticket) -> Answer:
        """The policy's provider for this request, asked directly (the stream validator's
        way out of a degenerate local answer). A policy without a usable provider, or a
        provider whose breaker is open, is an ApiError. Bounded by the ticket's deadline,
        as the fallback at the end of the local steps is."""
        job = ticket.job
        assert job is not None
        policy = ticket.policy
        provider = policy.fallback_provider
        if (
            provider is None
            or job.capability != "llm"
            or not self.providers.supports(provider.engine, job.route)
            or not self.routing.provider_allows(provider.engine, policy)
        ):
            raise ApiError(
                ErrorCode.NO_AGENTS_AVAILABLE,
                f"policy {policy.name} has no provider that can take this request",
            )
        try:
            async with asyncio.timeout_at(ticket.deadline):
                return await self._provider_answer(ticket, job, policy, provider)
        except TimeoutError:
            raise ApiError(
                ErrorCode.REQUEST_TIMEOUT, "Request deadline exceeded while contacting provider"
            ) from None

    async def _provider_answer(
        self, ticket: Ticket, job: Job, policy: Policy, provider: Provider
    ) -> Answer:
        routing = self.routing
        ticket.get(LEAVE_POOL)()  # the provider does not use the local pool's occupancy
        ticket.provider, ticket.origin = True, provider.engine
        ticket.phase = "provider"
        sent = self.clock.monotonic()
        breaker = routing.provider_started(provider.engine, policy)
        try:
            # The OpenAI API honours include_usage: ask it, as an engine is asked.
            asked = asking_for_usage(job, provider.engine == "openai")
            answer = await self.providers.forward(
                provider.engine,
                provider.model,
                job.route,
                asked or job.body,
                job.headers,
                job.stream,
            )
        except ProviderRefused as exc:
            # A request the provider judged bad (a 4xx other than overload or timeout) is
            # the client's doing, not the provider's failure.
            status = exc.upstream
            failed = False if status >= 500 or status in (408, 429) else None
            routing.provider_settled(provider.engine, policy, failed, breaker)
            raise
        except ApiError:
            routing.provider_settled(provider.engine, policy, False, breaker)
            raise
        except BaseException:
            routing.provider_settled(provider.engine, policy, self._blame(ticket), breaker)
            raise
        expect_usage(answer, job, provider.engine == native_provider(job))
        ok = None if 400 <= answer.status < 500 and answer.status != 429 else answer.status < 400
        routing.provider_settled(provider.engine, policy, ok, breaker)
        ticket.emit(
            AnswerHead(provider.engine, provider=True, seconds=self.clock.monotonic() - sent)
        )
        return answer


def _turn_away(agents: list[AgentRecord]) -> None:
    """Each full candidate turned this request away, once per request."""
    for agent in agents:
        if agent.eligible and agent.active >= agent.limit:
            agent.turned_away()


def _step_header(step: Step) -> str | None:
    """The header a consistent-hash step keys its sessions on, if it is such a step."""
    if step.strategy == "consistent-hash" and step.options.hash_key == "session":
        return step.options.hash_header
    return None


def _session_header(policy: Policy) -> str | None:
    """The header the policy's first session-keyed step keys on, if it has one."""
    return next(filter(None, map(_step_header, policy.steps)), None)


def _message(raw: bytes) -> str:
    return message_of(raw)[:MESSAGE_LIMIT]
