"""What prefix affinity costs the router per request: prompt_blocks + match + learn.

    python -m bench.affinity_cost
    python -m bench.affinity_cost --reps 50      # fewer repetitions, for a smoke run

The index first holds 64 agents x 4096 blocks (a full one, so every learn also evicts),
built from conversations that share one of eight system prompts. Then, for prompts of
1 KB, 64 KB, 1 MB and 8 MB, each given as one piece and as chat messages (a role and a
2 KB text each), a bounded number of requests is timed with time.perf_counter: hash the
prompt, match it against all 64 agents, learn it on the best one. Every request differs
from the others inside the hashed window, so none is a repeat. The memory columns come
from a second pass under tracemalloc, which would slow the timed one.
"""

from __future__ import annotations

import argparse
import statistics
import time
import tracemalloc
from collections.abc import Callable

from hivenet_router.routing.prefix import BLOCK_CHARS, MAX_BLOCKS, PrefixIndex, prompt_blocks

AGENTS = [f"agent-{i:02d}" for i in range(64)]
BLOCKS_PER_AGENT = 4096
SYSTEM_PROMPTS = [
    (f"System prompt {k}: you are a helpful assistant for team {k}. " * 80)[:4096] for k in range(8)
]
SIZES = [("1 KB", 1 << 10), ("64 KB", 64 << 10), ("1 MB", 1 << 20), ("8 MB", 8 << 20)]
MESSAGE_CHARS = 2048
FILLER = "".join(chr(ord("a") + (i * 7) % 26) for i in range(MESSAGE_CHARS))


def fill(index: PrefixIndex) -> None:
    """Fill every agent to its capacity with distinct conversations behind shared system
    prompts, the way an index looks after a while in production."""
    body = FILLER * (BLOCK_CHARS * MAX_BLOCKS // MESSAGE_CHARS)
    for number, agent in enumerate(AGENTS):
        index.set_capacity(agent, BLOCKS_PER_AGENT)
        for conversation in range(BLOCKS_PER_AGENT // MAX_BLOCKS + 1):
            system = SYSTEM_PROMPTS[(number + conversation) % len(SYSTEM_PROMPTS)]
            pieces = [system, "user", f"agent {number} conversation {conversation}\n{body}"]
            index.learn(prompt_blocks(pieces), agent, now=0.0)


class Prompts:
    """Distinct prompts of one size and form: the user text right after the system prompt
    carries the request number, so every request's hashed blocks differ after block 16."""

    def __init__(self, size: int, many: bool) -> None:
        self.size = size
        self.many = many
        self.system = SYSTEM_PROMPTS[0][: min(4096, size // 2)]
        rest = max(0, size - len(self.system) - 64)
        if many:
            self.tail: list[str] = []
            while rest > 0:
                role = "assistant" if len(self.tail) % 4 == 0 else "user"
                self.tail += [role, FILLER[: min(MESSAGE_CHARS, rest)]]
                rest -= MESSAGE_CHARS + len(role) + 2
            self.pieces = [self.system, "user", "", *self.tail]
        else:
            self.body = (FILLER * (rest // MESSAGE_CHARS + 1))[:rest]

    def get(self, number: int) -> list[str]:
        head = f"request {number}: please continue."
        if self.many:
            # The list is reused, so building a request costs no copy of the 8 MB.
            self.pieces[2] = head
            return self.pieces
        return [f"{self.system}\nuser\n{head}{self.body}"]


def one_request(index: PrefixIndex, pieces: list[str], now: float) -> tuple[float, float]:
    """Seconds spent hashing, and in match plus learn."""
    start = time.perf_counter()
    blocks = prompt_blocks(pieces)
    hashed = time.perf_counter()
    scores = index.match(blocks, AGENTS)
    best = max(scores, key=scores.__getitem__) if scores else AGENTS[int(now) % len(AGENTS)]
    index.learn(blocks, best, now)
    return hashed - start, time.perf_counter() - hashed


def measure(
    index: PrefixIndex, prompts: Prompts, reps: int, counter: Callable[[], int]
) -> dict[str, float]:
    hashing: list[float] = []
    routing: list[float] = []
    for _ in range(reps):
        number = counter()
        hash_seconds, route_seconds = one_request(index, prompts.get(number), float(number))
        hashing.append(hash_seconds)
        routing.append(route_seconds)
    totals = [a + b for a, b in zip(hashing, routing, strict=True)]
    # A few more requests under tracemalloc for the extra memory one of them needs.
    tracemalloc.start()
    peak = 0
    for _ in range(min(reps, 10)):
        number = counter()
        pieces = prompts.get(number)
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        one_request(index, pieces, float(number))
        peak = max(peak, tracemalloc.get_traced_memory()[1] - before)
    tracemalloc.stop()
    return {
        "median": statistics.median(totals) * 1e6,
        "p99": sorted(totals)[int(0.99 * (len(totals) - 1))] * 1e6,
        "hash": statistics.median(hashing) * 1e6,
        "route": statistics.median(routing) * 1e6,
        "peak": peak / 1024,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--reps", type=int, default=200, help="requests timed per row")
    args = parser.parse_args()

    tracemalloc.start()
    index = PrefixIndex(default_blocks_per_agent=BLOCKS_PER_AGENT, max_agents=len(AGENTS))
    fill(index)
    index_bytes = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    print(
        f"Index: {len(AGENTS)} agents x {BLOCKS_PER_AGENT} blocks, {index.total():,} entries, "
        f"{len(index._holders):,} distinct blocks, {index_bytes / 2**20:.1f} MiB "
        f"(tracemalloc). {args.reps} requests per row.\n"
    )
    print(
        "| prompt | form | pieces | blocks | µs/request p50 | p99 | hash p50 | "
        "match+learn p50 | index entries after | tracemalloc peak per request |"
    )
    print("|---|---|--:|--:|--:|--:|--:|--:|--:|--:|")
    numbers = iter(range(1 << 62))

    def counter() -> int:
        return next(numbers)

    for label, size in SIZES:
        for many in (False, True):
            prompts = Prompts(size, many)
            sample = prompts.get(-1)
            blocks = len(prompt_blocks(sample))
            row = measure(index, prompts, args.reps, counter)
            print(
                f"| {label} | {'messages' if many else 'one piece'} | {len(sample):,} | "
                f"{blocks} | {row['median']:.1f} | {row['p99']:.1f} | {row['hash']:.1f} | "
                f"{row['route']:.1f} | {index.total():,} | {row['peak']:.1f} KiB |"
            )


if __name__ == "__main__":
    main()
