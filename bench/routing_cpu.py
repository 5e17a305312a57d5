"""Routing CPU per request: `run_step` over 64 stand-in agents, by strategy.

    python -m bench.routing_cpu                       # 15 rounds of 2,000 requests each
    python -m bench.routing_cpu --rounds 5 --requests 500   # a smoke run

What is timed is what dispatch does per request on the event loop to pick an agent: build
the RouteInput, then `run_step` (filters, the strategy's scorers and picker, the prefix
match and, for predicted-latency, the prediction of every candidate). Hashing the prompt
into blocks happens inside (on the first use of `inp.blocks()`), as in dispatch. Learning
the prefix afterwards is left out (the index stays as built), and so is the agents' load
moving, but for a counter or two: the chosen agent takes a slot and, 256 requests later,
gives it back.

The state is what a busy fleet looks like and stays the same for every strategy and round:
64 agents of capacity 32 with 0 to 8 requests in flight (so all 64 pass the load guard of
max_imbalance 8 and are predicted); a prefix index holding, for each agent, sixteen
conversations behind one of eight system prompts (eight agents share each); learnt figures
for every agent (one not measured yet would be predicted with the fastest's figures and,
the state never changing, win most requests), taught to a RoutingState through its public calls
(`teach`) and read through the `rates` of the RouteInput it builds, as dispatch does; and
an engine snapshot with running and waiting counts for most. Requests are 1 KiB prompts
(four blocks) in three kinds, in turn: a conversation's continuation (four blocks cached
on one agent, two on seven more), a new conversation behind a known system prompt (two
blocks on eight agents), and a prompt nobody holds.

Strategies are timed in interleaved rounds (A, B, C, A, B, C, ...) and the best round of
each is reported, as microseconds per request: on a shared machine the best round is the
one least disturbed. The chosen agents of all requests are hashed into a digest per
strategy, so two versions of the code can be checked to decide alike.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import time
from collections import deque
from collections.abc import Callable

from tests.unit.policy.agents import Agent

from hivenet_router.clock import ManualClock
from hivenet_router.domain.agent import EngineSnapshot, Registration
from hivenet_router.domain.request import Job, RequestFacts, Usage
from hivenet_router.observability.events import Observers
from hivenet_router.pipeline.ticket import Ticket
from hivenet_router.policy.document import Step, parse_policy
from hivenet_router.policy.executor import run_step
from hivenet_router.policy.plugins import RouteInput
from hivenet_router.router.registry import AgentRecord, Registry
from hivenet_router.router.routing_state import RoutingState
from hivenet_router.routing.prefix import PrefixIndex, prompt_blocks
from hivenet_router.routing.ttft import Rates

AGENTS = 64
IN_FLIGHT = 64 * 4  # requests out at once, beyond the starting loads
CAPACITY = 32
PROMPT_CHARS = 1024
SYSTEMS = [
    (f"System prompt {k}: you are a helpful assistant for team {k}. " * 20)[:512] for k in range(8)
]
LEARN = parse_policy(
    "routing_policy: {strategy: predicted-latency}\n", "p.yaml", "p", require_models=False
)
STEPS = {
    "prefix-affinity": "{strategy: prefix-affinity}",
    "predicted-latency": "{strategy: predicted-latency}",
    "scored ttft": "{strategy: scored, scoring: {preset: latency-first, weights: {ttft: 0.3}}}",
}


def conversation(agent: int, number: int) -> str:
    """The text of one of an agent's conversations: its system prompt, then its own turns."""
    head = f"{SYSTEMS[agent % len(SYSTEMS)]}\nuser\nagent {agent} conversation {number}: "
    return (head + "lorem ipsum dolor sit amet " * 200)[: 4 * PROMPT_CHARS]


def teach(
    state: RoutingState, registry: Registry, clock: ManualClock, peer: str, rng: random.Random
) -> None:
    """Routing state learns an agent's figures the way it does in the router: a pick,
    `chosen`, then `settled` with the measured time to the first token, 24 times, prompts
    of different lengths and nothing cached. Base 8 to 40 ms, 20 to 200 us a prompt token,
    0.5 to 3 s a slot held; for most, a batch size from a last report of requests waiting."""
    reg = Registration(peer_id=peer, model="m1", capability="llm", engine="vllm", capacity=CAPACITY)
    record = AgentRecord(reg=reg, link=None, last_heartbeat=0.0, registered_at=0.0)
    registry.upsert(record)
    base, prefill = rng.uniform(0.008, 0.04), rng.uniform(20e-6, 200e-6)
    service = rng.uniform(0.5, 3.0)
    slots = rng.choice((None, 8, 16, 24))
    for n in range(25):
        text = f"{peer} {n} " + "x" * (256 + 160 * n)
        inp = state.input(ticket(text), LEARN, None)
        LEARN.steps[0].plan.choose(inp, [record])
        if n == 24:  # the last: only the engine's report of its batch size
            if slots:
                record.engine = EngineSnapshot(running_requests=slots, waiting_requests=1.0)
            state.chosen(inp, LEARN.steps[0], record, LEARN)
            break
        sent = state.chosen(inp, LEARN.steps[0], record, LEARN)
        clock.advance(service)
        tokens = len(text) / 4
        usage = Usage(int(tokens), 4)
        state.settled(record, LEARN, True, 1000 * (base + prefill * tokens), usage, True, sent)


def ticket(text: str) -> Ticket:
    made = Ticket("r", "/v1/chat/completions", 0.0, Observers([]))
    made.facts = facts(text)
    made.job = Job("/v1/chat/completions", "m1", "llm", True, b"{}", [])
    return made


def facts(text: str) -> RequestFacts:
    return RequestFacts(
        "/v1/chat/completions", "m1", "llm", True, 64, text_bytes=len(text), prompt=(text,)
    )


def fleet(rng: random.Random) -> tuple[list[Agent], Callable[[str], Rates], PrefixIndex]:
    """The stand-in agents, the learnt figures as dispatch hands them to routing (the
    `rates` of the RouteInput that RoutingState.input builds), and the prefix index."""
    index = PrefixIndex(default_blocks_per_agent=4096, max_agents=AGENTS)
    clock, registry = ManualClock(), Registry()
    state = RoutingState(clock, registry)
    agents: list[Agent] = []
    for number in range(AGENTS):
        peer = f"agent-{number:02d}"
        reg = Registration(
            peer_id=peer, model="m1", capability="llm", engine="vllm", capacity=CAPACITY
        )
        engine = None
        if number % 5:
            running = float(rng.randint(0, 24))
            waiting = float(rng.choice((0, 0, 0, 1, 3)))
            engine = EngineSnapshot(running_requests=running, waiting_requests=waiting)
        agents.append(
            Agent(reg, active=rng.randint(0, 8), engine=engine, last_assigned=rng.randrange(10**6))
        )
        teach(state, registry, clock, peer, rng)
        for talk in range(16):
            index.learn(prompt_blocks([conversation(number, talk)]), peer, now=0.0)
    return agents, state.input(ticket("x"), LEARN, None).rates, index


def prompt(number: int) -> str:
    kind = number % 3
    if kind == 0:  # a continuation: its first 1 KiB was sent to one agent
        return conversation((number * 7) % AGENTS, (number // 3) % 16)[:PROMPT_CHARS]
    if kind == 1:  # a new conversation behind a known system prompt
        text = f"{SYSTEMS[number % len(SYSTEMS)]}\nuser\nnew request {number}: "
    else:  # nothing anyone holds
        text = f"unheard-of request {number}: "
    return (text + "consectetur adipiscing elit " * 60)[:PROMPT_CHARS]


def step_of(text: str) -> Step:
    return parse_policy(f"routing_policy: {text}\n", "p.yaml", "p", require_models=False).steps[0]


def run(
    step: Step,
    facts: list[RequestFacts],
    agents: list[Agent],
    index: PrefixIndex,
    rates: Callable[[str], Rates],
) -> tuple[float, list[str]]:
    """Seconds for routing every request once, and whom each went to. Loads move as in
    the router: the chosen agent takes a slot (and becomes the most recently chosen), and
    once IN_FLIGHT requests are out the oldest ends. Every run starts from the same loads."""
    start_loads = [(a.active, a.last_assigned) for a in agents]
    chosen: list[str] = []
    failed: frozenset[str] = frozenset()
    rng = random.Random(7)
    out: deque[Agent] = deque()
    order = 10**6
    start = time.perf_counter()
    for fact in facts:
        inp = RouteInput(fact, affinity=index, rng=rng, rates=rates)
        agent = run_step(step, inp, agents, failed).agent
        if agent is None:
            chosen.append("-")
            continue
        chosen.append(agent.peer_id)
        agent.active += 1
        order += 1
        agent.last_assigned = order
        out.append(agent)
        if len(out) > IN_FLIGHT:
            out.popleft().active -= 1
    seconds = time.perf_counter() - start
    for a, (active, last) in zip(agents, start_loads, strict=True):
        a.active, a.last_assigned = active, last
    return seconds, chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds")
    parser.add_argument("--requests", type=int, default=2000, help="requests per round")
    parser.add_argument("--strategies", default=",".join(STEPS), help="comma-separated")
    args = parser.parse_args()

    agents, rates, index = fleet(random.Random(40))
    texts = [prompt(n) for n in range(args.requests)]
    requests = [facts(t) for t in texts]
    names = [n.strip() for n in args.strategies.split(",") if n.strip()]
    steps = {name: step_of(STEPS[name]) for name in names}
    best = dict.fromkeys(names, float("inf"))
    digests: dict[str, str] = {}
    for name in names:  # warm up, and the decisions (the same in every round)
        _, chosen = run(steps[name], requests, agents, index, rates)
        digests[name] = hashlib.sha256("\n".join(chosen).encode()).hexdigest()[:16]
    for _ in range(args.rounds):
        for name in names:
            seconds, _ = run(steps[name], requests, agents, index, rates)
            best[name] = min(best[name], seconds)
    load = os.getloadavg()
    print(
        f"{AGENTS} agents, {PROMPT_CHARS}-character prompts, {args.requests} requests x "
        f"{args.rounds} rounds, best round; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
    )
    base = best.get("prefix-affinity")
    for name in names:
        us = best[name] / args.requests * 1e6
        ratio = f"  {best[name] / base:.2f}x prefix-affinity" if base else ""
        print(f"{name:20s} {us:7.1f} us/request  decisions {digests[name]}{ratio}")


if __name__ == "__main__":
    main()
