"""What routing learns from traffic: a circuit breaker per agent and per provider, an
adaptive (Vegas) concurrency limit per agent, each model's index of the prompt
prefixes sent to each agent, and each agent's time to the first token (its base latency,
prefill rate and service time, for the predicted-latency strategy; routing/ttft.py).

Dispatch tells it three things and asks it one: `input` builds a request's routing input,
`chosen` records where a request went, `settled` (or `cut_short`) how it ended, and
`prepare` readies a pick: the agents' adaptive limits, and whether each one's breaker lets
a request through. The settings come with the policy of the
request's model at each call, so a policy reload takes effect on the next request.
Everything here is in-process and per router.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from hivenet_router.clock import Clock
from hivenet_router.domain.agent import PREFIX_HEADER, CacheReport, pack_blocks, unpack_blocks
from hivenet_router.domain.request import Usage
from hivenet_router.pipeline.ticket import Ticket
from hivenet_router.policy.document import Policy, Step
from hivenet_router.policy.plugins import RouteInput
from hivenet_router.policy.predicted import Prediction, prediction_of, uncached_known
from hivenet_router.policy.signals import AgentFacts
from hivenet_router.router.registry import AgentRecord, Registry
from hivenet_router.routing.breaker import Breaker, BreakerSettings, BreakerState
from hivenet_router.routing.prefix import BLOCK_CHARS, PrefixIndex
from hivenet_router.routing.ttft import Learner, Rates, median
from hivenet_router.routing.vegas import VegasLimiter

# The simulator and the engines count about four characters per token.
CHARS_PER_TOKEN = 4
# A request's cost in the fair queue when it declares no output limit.
DEFAULT_OUTPUT_TOKENS = 256
# Predictions whose error the metric summarises: the most recent ones.
ERROR_WINDOW = 512
# Seconds between looks for stale learnt figures (one look a measured answer at most).
SWEEP_S = 1.0
_COLD = Rates()


class _Figures(dict[str, Rates]):
    """Learnt figures by peer ID; an agent nothing was learnt of has the cold-start ones.
    Read through `__getitem__`, which runs no Python code for a peer it holds."""

    def __missing__(self, peer: str) -> Rates:
        return _COLD


@dataclass(slots=True)
class Sent:
    """A request handed to an agent, as routing remembers it until the answer ends: the
    breaker's ticket, when it left, and the time to its first token predicted for it."""

    breaker: int = 0
    at: float = 0.0
    prediction: Prediction | None = None
    prefix: str | None = None  # the prompt's prefix blocks for the agent's cache picture

    def forwarded(self, headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
        """The request's headers to the agent, with the prompt's prefix blocks when routing
        went by them: the agent keeps its picture of its engine's cache from these."""
        if self.prefix is None:
            return headers
        return [*headers, (PREFIX_HEADER, self.prefix)]


def header_value(headers: Sequence[tuple[str, str]], header: str) -> str | None:
    """The first value of `header` (lower case) among a forwarded request's headers."""
    for name, value in headers:
        if name.lower() == header:
            return value
    return None


@dataclass(slots=True)
class _Target:
    """A breaker and what the admin view says about it."""

    breaker: Breaker
    settings: BreakerSettings  # the last the policy gave it, for views between requests
    since_closed: int = 0  # outcomes recorded since it was last closed
    opened_after: int | None = None  # outcomes it took to open it, the last time


class RoutingState:
    def __init__(self, clock: Clock, registry: Registry, seed: int | None = None) -> None:
        self.clock = clock
        self.registry = registry
        self.rng = random.Random(seed)
        self._agents: dict[str, _Target] = {}
        self._providers: dict[str, _Target] = {}
        self._limiters: dict[str, VegasLimiter] = {}
        self._indexes: dict[str, PrefixIndex] = {}
        self._learners: dict[str, Learner] = {}
        # Each learner's figures by peer ID, refreshed whenever a learner takes something
        # in: what a pick reads for every candidate, so `_rates` is a plain dict lookup.
        self._figures = _Figures()
        self._rates: Callable[[str], Rates] = self._figures.__getitem__
        # Recent predictions' relative errors, (predicted - measured) / measured.
        self._errors: deque[float] = deque(maxlen=ERROR_WINDOW)
        self._predictions = 0
        self._swept = 0.0  # when stale figures were last looked for
        self.reports = 0  # cache reports applied
        registry.listen(self._registration)

    # -- a request -------------------------------------------------------------------------

    def input(self, ticket: Ticket, policy: Policy, header: str | None) -> RouteInput:
        facts = ticket.facts
        job = ticket.job
        assert facts is not None and job is not None
        session = header_value(job.headers, header) if header is not None else None
        now = self.clock.monotonic()
        settings = policy.breaker
        return RouteInput(
            facts,
            now=now,
            session=session,
            affinity=self._index(facts.model),
            rng=self.rng,
            health=lambda peer: self._health(peer, now, settings),
            rates=self._rates,
        )

    def prepare(
        self, inp: RouteInput, policy: Policy, agents: list[AgentRecord]
    ) -> Callable[[AgentFacts], bool]:
        """Before a step picks among `agents`: their adaptive limits, the time the pick
        sees, and who the breakers let through (`adapt` and `admits`, in one call)."""
        self.adapt(policy, agents)
        inp.now = now = self.clock.monotonic()
        return self.admits(policy, now)

    def admits(self, policy: Policy, now: float | None = None) -> Callable[[AgentFacts], bool]:
        settings = policy.breaker
        if not settings.enabled or not self._agents:
            return _everyone
        if now is None:
            now = self.clock.monotonic()
        targets = self._agents

        def admits(agent: AgentFacts) -> bool:
            target = targets.get(agent.peer_id)
            return target is None or target.breaker.allows(now, settings)

        return admits

    def adapt(self, policy: Policy, agents: list[AgentRecord]) -> None:
        """Hold each agent to its adaptive limit when the policy asks for one, and give the
        whole capacity back when it does not."""
        settings = policy.adaptive
        if not settings.enabled and not self._limiters:
            return  # never on: nothing to hold back or to give back (the common case)
        for agent in agents:
            if settings.enabled:
                limiter = self._limiters.get(agent.peer_id)
                if limiter is None:
                    limiter = self._limiters[agent.peer_id] = VegasLimiter(agent.capacity, settings)
                agent.limit_slots(limiter.limit)
            elif agent.slot_limit:
                agent.limit_slots(0)

    def chosen(self, inp: RouteInput, step: Step, agent: AgentRecord, policy: Policy) -> Sent:
        """The request goes to `agent`: note it, and return what `settled` will want back
        (the breaker's ticket, the prediction to learn from)."""
        sent = Sent(at=self.clock.monotonic())
        if step.plan.predicts:
            sent.prediction = prediction_of(inp, agent.peer_id)
            learner = self._learner(agent.peer_id)
            if learner.stale(sent.at):
                learner.probed = sent.at  # tried again: shown as measured until the next due
            engine = agent.engine
            if engine is not None:
                learner.engine_load(engine.running_requests, engine.waiting_requests)
                if engine.prompt_tps:
                    learner.prior(1.0 / engine.prompt_tps)
            self._figures[agent.peer_id] = learner.rates
        if step.plan.uses_prefix:
            index = inp.affinity
            blocks = inp.blocks()
            if index is not None and blocks:
                tokens = agent.engine.kv_cache_tokens if agent.engine is not None else None
                held = int(tokens * CHARS_PER_TOKEN) // BLOCK_CHARS if tokens else 0
                if held > 0:  # a nonsense (negative, tiny) report leaves the default
                    index.set_capacity(agent.peer_id, held)
                index.learn(blocks, agent.peer_id, inp.now)
                sent.prefix = pack_blocks(blocks)
        if policy.breaker.enabled:
            target = self._target(self._agents, agent.peer_id, policy.breaker)
            sent.breaker = target.breaker.started(sent.at, policy.breaker)
        return sent

    def settled(
        self,
        agent: AgentRecord,
        policy: Policy,
        ok: bool | None,
        latency_ms: float | None,
        usage: Usage | None,
        stream: bool,
        sent: Sent,
    ) -> None:
        """How a request sent to `agent` ended: `ok` None when it was the client's doing.
        `latency_ms` is the time to the answer's head (with a stream's first chunk). The
        agent's own statistics count it (`AgentRecord.finished`), and routing learns."""
        agent.finished(ok, latency_ms if ok else None, usage)
        if ok and sent.prediction is not None:
            self._measured(agent.peer_id, sent, latency_ms if stream else None)
        self._learn(agent, policy, ok, latency_ms, stream, sent.breaker)

    def cache_report(self, agent: AgentRecord, report: CacheReport) -> None:
        """What the agent says its engine holds of the prompts sent to it by any router
        (agent/cache_picture.py): the model's index follows it. ValueError for a report
        whose blocks do not decode (nothing of it is applied then)."""
        changes = [(change.held, unpack_blocks(change.blocks)) for change in report.changes]
        index = self._index(agent.model)
        peer = agent.peer_id
        engine = agent.engine
        tokens = engine.kv_cache_tokens if engine is not None else None
        held = int(tokens * CHARS_PER_TOKEN) // BLOCK_CHARS if tokens else 0
        if held > 0:
            index.set_capacity(peer, held)
        if report.full:
            index.forget(peer)
        now = self.clock.monotonic()
        for stored, blocks in changes:
            if stored:
                index.hold(peer, blocks)
                index.touched(peer, now)
            else:
                index.drop(peer, blocks)
        self.reports += 1

    def cut_short(self, agent: AgentRecord, policy: Policy, ok: bool | None, sent: Sent) -> None:
        """An attempt on `agent` stopped before its answer's head by a cancel (the client
        went away, the router stops) or the deadline (`ok` False): routing learns, and the
        agent's statistics count nothing."""
        self._learn(agent, policy, ok, None, False, sent.breaker)

    def _measured(self, peer: str, sent: Sent, ttft_ms: float | None) -> None:
        """A predicted request's answer ended well: how long it held the engine, and for a
        stream how long its first chunk took, against the prediction."""
        prediction = sent.prediction
        assert prediction is not None
        learner = self._learner(peer)
        learner.served(self.clock.monotonic() - sent.at)
        self._figures[peer] = learner.rates
        if ttft_ms is None or ttft_ms <= 0:
            return
        measured = ttft_ms / 1000
        self._predictions += 1
        self._errors.append((prediction.seconds - measured) / measured)
        now = self.clock.monotonic()
        if uncached_known(prediction):
            uncached = prediction.prompt_tokens - prediction.cached_tokens
            learner.observe(uncached, max(0.0, measured - prediction.wait_s), now)
            self._figures[peer] = learner.rates
        if now - self._swept >= SWEEP_S:
            self._sweep(now)

    def _sweep(self, now: float) -> None:
        """Lend the fleet's fastest measured prefill rate to each agent whose own
        observations have not told its rate yet (routing/ttft.py, `borrow`), and show each
        stale agent's figures as not measured, so that a pick tries it again (STALE_S);
        its own figures come back when it is chosen."""
        self._swept = now
        figures = self._figures
        learners = self._learners
        slopes = [learner.rates.prefill_s for learner in learners.values() if learner.sloped]
        fastest = min(slopes) if slopes else None
        for peer, learner in learners.items():
            if not learner.sloped:
                learner.borrow(fastest)
                figures[peer] = learner.rates
            if learner.due(now):
                rates = learner.rates
                figures[peer] = Rates(rates.base_s, rates.prefill_s, rates.service_s, rates.slots)

    def _learn(
        self,
        agent: AgentRecord,
        policy: Policy,
        ok: bool | None,
        latency_ms: float | None,
        stream: bool,
        ticket: int,
    ) -> None:
        agent.served(ok)
        if policy.breaker.enabled:
            self._record(self._agents, agent.peer_id, ok, policy.breaker, ticket)
        settings = policy.adaptive
        limiter = self._limiters.get(agent.peer_id)
        if limiter is None or not settings.enabled:
            if agent.slot_limit:
                agent.limit_slots(0)
            return
        if ok is False:
            agent.limit_slots(limiter.dropped(agent.capacity, settings))
        elif ok and latency_ms is not None and stream:
            # Only streams' time to the first chunk: it measures queueing and prefill alone,
            # where a whole answer's time also grows with its length (one limiter fed both
            # would compare milliseconds per token with milliseconds per request).
            agent.limit_slots(limiter.sample(latency_ms, agent.active, agent.capacity, settings))

    def all_open(self, policy: Policy, agents: list[AgentRecord]) -> float | None:
        """Seconds until the first of these agents' breakers lets a probe through, when
        every one of them is refusing requests; None when some agent takes requests."""
        settings = policy.breaker
        if not settings.enabled or not agents:
            return None
        now = self.clock.monotonic()
        soonest: float | None = None
        for agent in agents:
            target = self._agents.get(agent.peer_id)
            if target is None or target.breaker.allows(now, settings):
                return None
            wait = target.breaker.probe_in(now, settings)
            soonest = wait if soonest is None else min(soonest, wait)
        return soonest

    def next_probe(self, policy: Policy, agents: Iterable[AgentRecord]) -> float | None:
        """Seconds until the first open breaker among these agents lets a probe through;
        None when none of them is open."""
        settings = policy.breaker
        if not settings.enabled or not self._agents:
            return None
        now = self.clock.monotonic()
        soonest: float | None = None
        for agent in agents:
            target = self._agents.get(agent.peer_id)
            if target is None:
                continue
            breaker = target.breaker
            if breaker.state(now, settings) is not BreakerState.OPEN:
                continue
            wait = breaker.probe_in(now, settings)
            soonest = wait if soonest is None else min(soonest, wait)
        return soonest

    # -- providers -------------------------------------------------------------------------

    def provider_allows(self, name: str, policy: Policy) -> bool:
        # Provider breakers are shared by every policy that falls back to the provider: a
        # policy with breakers off neither consults nor resets them.
        target = self._providers.get(name)
        if target is None or not policy.breaker.enabled:
            return True
        return target.breaker.allows(self.clock.monotonic(), policy.breaker)

    def provider_started(self, name: str, policy: Policy) -> int:
        if not policy.breaker.enabled:
            return 0
        target = self._target(self._providers, name, policy.breaker)
        return target.breaker.started(self.clock.monotonic(), policy.breaker)

    def provider_settled(self, name: str, policy: Policy, ok: bool | None, ticket: int) -> None:
        if policy.breaker.enabled:
            self._record(self._providers, name, ok, policy.breaker, ticket)

    # -- views -----------------------------------------------------------------------------

    def agent_view(self, peer: str, settings: BreakerSettings) -> dict[str, object]:
        """The admin routing table's routing section of one agent."""
        view: dict[str, object] = {}
        target = self._agents.get(peer)
        now = self.clock.monotonic()
        breaker = target.breaker if target is not None else Breaker()
        view["breaker"] = {
            **breaker.snapshot(now, settings),
            "opened_after": target.opened_after if target is not None else None,
        }
        limiter = self._limiters.get(peer)
        if limiter is not None:
            view["adaptive_concurrency"] = limiter.snapshot()
        held = sum(index.size(peer) for index in self._indexes.values())
        view["prefix_blocks"] = held
        learner = self._learners.get(peer)
        if learner is not None:
            rates = learner.rates
            view["predicted_latency"] = {
                "base_ms": round(rates.base_s * 1000, 3),
                "prefill_us_per_token": round(rates.prefill_s * 1e6, 3),
                "service_ms": None if rates.service_s is None else round(rates.service_s * 1000),
                "engine_slots": rates.slots,
                "samples": rates.samples,
                "stale": learner.stale(now),
            }
        return view

    def prediction_errors(self) -> tuple[int, float | None, float | None]:
        """Predictions measured so far, and the median and 90th percentile of the recent
        ones' absolute relative error (None before the first)."""
        errors = sorted(abs(e) for e in self._errors)
        if not errors:
            return self._predictions, None, None
        p90 = errors[min(len(errors) - 1, int(0.9 * len(errors)))]
        return self._predictions, median(errors), p90

    def breakers(self) -> Iterator[BreakerRow]:
        """(kind, target, state, transitions) for every breaker, for metrics."""
        now = self.clock.monotonic()
        for kind, targets in (("agent", self._agents), ("provider", self._providers)):
            for name, target in list(targets.items()):
                state = target.breaker.state(now, target.settings)
                yield kind, name, state.value, dict(target.breaker.transitions)

    def limits(self) -> Iterator[tuple[str, int]]:
        for peer, limiter in list(self._limiters.items()):
            yield peer, limiter.limit

    def prefix_blocks(self) -> Iterator[tuple[str, int]]:
        for model, index in list(self._indexes.items()):
            yield model, index.total()

    # -- inside ----------------------------------------------------------------------------

    def _learner(self, peer: str) -> Learner:
        learner = self._learners.get(peer)
        if learner is None:
            learner = self._learners[peer] = Learner()
        return learner

    def _index(self, model: str) -> PrefixIndex:
        index = self._indexes.get(model)
        if index is None:
            index = self._indexes[model] = PrefixIndex()
        return index

    @staticmethod
    def _target(targets: dict[str, _Target], name: str, settings: BreakerSettings) -> _Target:
        target = targets.get(name)
        if target is None:
            target = targets[name] = _Target(Breaker(), settings)
        target.settings = settings
        return target

    def _record(
        self,
        targets: dict[str, _Target],
        name: str,
        ok: bool | None,
        settings: BreakerSettings,
        ticket: int,
    ) -> None:
        target = targets.get(name)
        if target is None:
            return
        if ok is not None:
            target.since_closed += 1
        changed = target.breaker.record(ok, self.clock.monotonic(), settings, ticket)
        if changed is BreakerState.OPEN and target.opened_after is None:
            target.opened_after = target.since_closed
        elif changed is BreakerState.CLOSED:
            target.since_closed = 0

    def _health(self, peer: str, now: float, settings: BreakerSettings) -> float:
        target = self._agents.get(peer)
        if target is None:
            return 1.0
        breaker = target.breaker
        if breaker.state(now, settings) is not BreakerState.CLOSED:
            return 0.0
        outcomes = breaker.outcomes_in_window
        return 1.0 - breaker.failures_in_window / outcomes if outcomes else 1.0

    def _registration(self, change: str, record: AgentRecord) -> None:
        if change != "unregistered":
            limiter = self._limiters.get(record.peer_id)
            if limiter is not None:
                limiter.resize(record.capacity)
            return
        # Gone for good: what was learnt about it would only mislead a newcomer.
        self._agents.pop(record.peer_id, None)
        self._limiters.pop(record.peer_id, None)
        self._learners.pop(record.peer_id, None)
        self._figures.pop(record.peer_id, None)
        for index in self._indexes.values():
            index.forget(record.peer_id)


BreakerRow = tuple[str, str, str, dict[str, int]]


def _everyone(agent: AgentFacts) -> bool:
    return True


def queue_cost(ticket: Ticket) -> float:
    """A waiting request's weight in the fair queue: its tokens, estimated."""
    facts = ticket.facts
    if facts is None:
        return 1.0
    output = facts.max_output_tokens or DEFAULT_OUTPUT_TOKENS
    return max(1.0, facts.text_bytes / CHARS_PER_TOKEN + output)
