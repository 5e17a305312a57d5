"""An independent checker of the limits the routers of one site share (--sync-store=valkey).

It knows nothing of the router's code: it reads what an operator could read (the Valkey
store, each router's GET /admin/sync and /metrics) and what the clients were answered,
and checks four invariants of the spec (multi-router-sync.txt):

1. Occupancy. At every store sample the routers together hold at most the model's budget
   (the sum of the pool hash `hivenet:{site}:pool:<model>`, stale fields of dead routers
   included). At every sample of the routers' views, the sum of their `in_use` is at most
   the budget too. The views are fetched at the same moment, one thread per router; a view
   sample whose fetches spread over more than `max_spread` seconds is counted as skewed and
   not judged, because credits a router handed back between two fetches may show twice.
   Requests declare max_tokens, so no reservation grows while it streams.

2. Request rate. For a key with a requests-per-minute limit L on a site of N routers, the
   requests the site admitted inside any 60 s window are at most

       L + ceil(L * T / 60) + ceil(L * (N - 1) / N) + 1

   where T <= 60 is the time from the window's start to the end of its last admitted request.
   L is the bucket a key starts with; L * T / 60 is what a per-minute bucket refills in T
   (one router alone allows this much: the limit is a rate, not a fixed window); the last two
   terms are "one sync interval's worth": in one round every other router may spend its
   whole share (L / N each) before this one hears of it, plus one for a request admitted
   while the round that reports it is in flight. An answer counts as admitted by the rate
   gate when it was not a 429, or was a 429 of a gate the docs place after the rate
   (docs/admission.md: concurrency_limit_exceeded, token_limit_exceeded); that is never
   fewer than the answers that were not a 429, so the check is at least as strict. A 5xx
   was admitted too; a request that got no HTTP answer at all is not counted (it may never
   have reached admission). A request counts in a window only when it started and ended
   inside it, so no request is counted where it could not have been.

3. Daily totals. Once every request has ended and a few rounds passed, each budget key's
   settled fields in the store (`hivenet:{site}:day:<date>:<key>`, fields without "~",
   summed over routers and dates) equal the tokens the clients were answered with
   (usage.total_tokens). When a key has a tokens-per-day limit, what the clients were
   answered with stays within it.

4. No request waits on the store. Every answer (429s included) came within `latency_bound`
   seconds, which the test derives from its simulator's latency plus the spec's only store
   waits (the first daily read, 200 ms, and the park timeout of a wallet that asks for
   credits, 250 ms) plus scheduling slack. A wait on the store happens inside a router, so
   an answer slower than the bound at the client is held against the site only when the
   router's own record of it (its audit log's latency_ms, found by the X-Request-ID the
   client sent; `server_latency`) is over the bound too: the rest is time the client or the
   operating system lost, which a busy shared machine shows now and then. An answer the
   router did not record (a router killed) is judged by its client latency. Each router's
   sync rounds stay short: a round is two store calls, each cut at the client's 0.5 s
   timeout, so one lasting more than `round_bound` seconds is counted (the histogram's
   +Inf bucket above 1.0 s).

Every loop is bounded: the samplers stop at `stop()`, after `max_samples` samples, or after
`max_seconds`, whichever comes first.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any
from urllib.parse import quote

import httpx2 as httpx
import valkey
from valkey.cluster import ClusterNode

from tests.procs import ADMIN_KEY, metric

CLUSTER = "cluster:"  # a store address naming a Valkey Cluster's nodes: "cluster:HOST:PORT,..."

WINDOW = 60.0
IN_FLIGHT = "~"
# 429 codes of the gates after the request rate (docs/admission.md): such a request was
# charged to the rate before it was refused.
AFTER_RATE = frozenset({"concurrency_limit_exceeded", "token_limit_exceeded"})


@dataclass(frozen=True, slots=True)
class Answer:
    """What one client request got: `status` is the HTTP status, 0 when none came."""

    key: str  # the budget key (the API key's owner for a flat quota)
    started: float  # time.monotonic() when the request was sent
    finished: float  # ... and when its answer (or error) came back
    status: int
    tokens: int = 0  # usage.total_tokens of an answered request
    router: str = ""
    code: str = ""  # the error code of a refusal
    request_id: str = ""  # the X-Request-ID the client sent

    @property
    def latency(self) -> float:
        return self.finished - self.started

    @property
    def admitted(self) -> bool:
        """Answered, and not refused with a 429."""
        return self.status not in {0, 429}

    @property
    def passed_rate(self) -> bool:
        """Went through the request-rate gate (see invariant 2)."""
        return self.admitted or (self.status == 429 and self.code in AFTER_RATE)


@dataclass(slots=True)
class _Worst:
    pool_held: int = 0  # most credits the store showed held at once
    in_use: int = 0  # most the routers' views showed in use at once (judged samples)
    latency: float = 0.0  # at the client
    router_latency: float = 0.0  # the router's record of the answers over the bound
    spread: float = 0.0  # widest spread of a judged view sample
    admitted: dict[str, int] = field(default_factory=dict)  # per rate-limited key
    allowed: dict[str, int] = field(default_factory=dict)  # the bound at that window


def admitted_bound(limit: int, routers: int, elapsed: float) -> int:
    """Invariant 2's bound (see the module docstring)."""
    elapsed = min(max(elapsed, 0.0), WINDOW)
    return (
        limit + math.ceil(limit * elapsed / WINDOW) + math.ceil(limit * (routers - 1) / routers) + 1
    )


def worst_window(answers: Sequence[Answer], limit: int, routers: int) -> tuple[int, int]:
    """(admitted, bound) of the 60 s window that comes closest to its bound."""
    done = sorted((a for a in answers if a.passed_rate), key=lambda a: a.started)
    best = (0, admitted_bound(limit, routers, 0.0))
    for index, first in enumerate(done):
        start = first.started
        inside = [a for a in done[index:] if a.finished <= start + WINDOW]
        if not inside:
            continue
        bound = admitted_bound(limit, routers, max(a.finished for a in inside) - start)
        if len(inside) - bound > best[0] - best[1]:
            best = (len(inside), bound)
    return best


class SiteChecker:
    """Samples a site in background threads while a test drives it; `record` takes every
    client answer. Use as a context manager (or start/stop), then `verify_daily`,
    `check_rounds`, `report()` and `assert_ok()`."""

    def __init__(
        self,
        routers: Iterable[str],
        store: Callable[[], str] | None,
        *,
        model: str,
        budget: int,
        latency_bound: float,
        site: str = "test-site",
        rate_limits: dict[str, int] | None = None,
        daily_limits: dict[str, int] | None = None,
        server_latency: Callable[[], dict[str, float]] | None = None,
        interval: float = 0.05,
        max_samples: int = 4000,
        max_seconds: float = 120.0,
        max_spread: float = 0.03,
        round_bound: float = 1.0,
    ) -> None:
        self.routers = list(routers)  # base URLs
        self.site_routers = len(self.routers)  # N of invariant 2
        self._resolve = store
        self.model = model
        self.budget = budget
        self.latency_bound = latency_bound
        self.site = site
        self.rate_limits = dict(rate_limits or {})
        self.daily_limits = dict(daily_limits or {})
        self.server_latency = server_latency
        self.slow = {"at_client": 0, "at_router": 0}
        self.interval = interval
        self.max_samples = max_samples
        self.max_seconds = max_seconds
        self.max_spread = max_spread
        self.round_bound = round_bound
        self.violations: list[str] = []
        self.answers: list[Answer] = []
        self.worst = _Worst()
        self.counts = {
            "store_samples": 0,
            "store_unreadable": 0,
            "view_samples": 0,
            "view_skewed": 0,
            "view_unreadable": 0,
        }
        self.daily: dict[str, dict[str, int]] = {}
        self.store_down: dict[str, int] = {}  # view samples in which a router's store was down
        self.rounds: dict[str, dict[str, float]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._addr = ""
        self._addr_at = 0.0
        self._began = 0.0
        self._checked = False

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> SiteChecker:
        self._began = time.monotonic()
        samplers = [self._sample_views]
        if self._resolve is not None:  # None: a store that cannot be read (views only)
            samplers.append(self._sample_store)
        for target in samplers:
            thread = threading.Thread(target=target, name=f"checker-{target.__name__}", daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=10)
        self._threads.clear()

    def __enter__(self) -> SiteChecker:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def add_router(self, url: str) -> None:
        """A router that joined the site (sampled from now on)."""
        with self._lock:
            if url not in self.routers:
                self.routers.append(url)
                self.site_routers = max(self.site_routers, len(self.routers))

    def record(self, answer: Answer) -> None:
        with self._lock:
            self.answers.append(answer)
            if answer.status != 0:
                self.worst.latency = max(self.worst.latency, answer.latency)

    def _violate(self, text: str) -> None:
        with self._lock:
            if len(self.violations) < 200:
                self.violations.append(text)

    def _running(self, samples: int) -> bool:
        return (
            not self._stop.is_set()
            and samples < self.max_samples
            and time.monotonic() - self._began < self.max_seconds
        )

    # -- invariant 1: the store ---------------------------------------------------------------

    def pool_key(self, model: str | None = None) -> str:
        return f"hivenet:{{{self.site}}}:pool:{quote(model or self.model, safe='')}"

    def store_addr(self, refresh: bool = False) -> str:
        """The primary's address, asked again at most every half second after a failure."""
        now = time.monotonic()
        if self._resolve is None:
            raise OSError("this checker reads no store")
        if not self._addr or (refresh and now - self._addr_at >= 0.5):
            try:
                self._addr = self._resolve()
            except Exception:  # no Sentinel answers right now: keep the old one
                if not self._addr:
                    raise
            self._addr_at = now
        return self._addr

    def _client(self, timeout: float = 0.25) -> Any:
        addr = self.store_addr()
        if addr.startswith(CLUSTER):  # a Valkey Cluster: "cluster:HOST:PORT,..."
            nodes = [node.rpartition(":") for node in addr.removeprefix(CLUSTER).split(",")]
            startup = [ClusterNode(host, int(port)) for host, _, port in nodes]  # type: ignore[no-untyped-call]
            return valkey.ValkeyCluster(
                startup_nodes=startup,
                socket_timeout=timeout,
                socket_connect_timeout=timeout,
                decode_responses=True,
            )
        host, _, port = addr.rpartition(":")
        return valkey.Valkey(
            host=host,
            port=int(port),
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            decode_responses=True,
        )

    def pool(self) -> dict[str, int]:
        """Credits each router holds in the store now (raises when the store does not answer)."""
        with self._client() as client:
            held: dict[str, str] = client.hgetall(self.pool_key())
        return {who: int(amount) for who, amount in held.items()}

    def _sample_store(self) -> None:
        samples = 0
        while self._running(samples):
            samples += 1
            try:
                held = self.pool()
            except (valkey.ValkeyError, OSError, ValueError):
                self.counts["store_unreadable"] += 1
                with contextlib.suppress(Exception):  # the next sample tries again
                    self.store_addr(refresh=True)
                self._stop.wait(self.interval)
                continue
            total = sum(held.values())
            self.counts["store_samples"] += 1
            self.worst.pool_held = max(self.worst.pool_held, total)
            if total > self.budget:
                self._violate(
                    f"the store shows {total} credits held of a {self.budget} budget: {held}"
                )
            self._stop.wait(self.interval)

    # -- invariant 1: the routers' views ------------------------------------------------------

    def _sample_views(self) -> None:
        headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
        samples = 0
        with (
            ThreadPoolExecutor(max_workers=8) as pool,
            httpx.Client(headers=headers, timeout=1.0) as client,
        ):

            def fetch(url: str) -> tuple[float, float, dict[str, Any] | None]:
                began = time.monotonic()
                try:
                    answer = client.get(url + "/admin/sync")
                    view = answer.json() if answer.status_code == 200 else None
                except (httpx.HTTPError, ValueError):
                    view = None
                return began, time.monotonic(), view

            while self._running(samples):
                samples += 1
                with self._lock:
                    routers = list(self.routers)
                results = list(pool.map(fetch, routers))
                self._judge_views(routers, results)
                self._stop.wait(self.interval)

    def _judge_views(
        self, routers: list[str], results: list[tuple[float, float, dict[str, Any] | None]]
    ) -> None:
        views = [view for _, _, view in results]
        for url, view in zip(routers, views, strict=True):
            if view is not None and view.get("store_up") is not True:
                self.store_down[url] = self.store_down.get(url, 0) + 1
        if any(view is None for view in views):
            self.counts["view_unreadable"] += 1  # a router down or restarting
            return
        spread = max(end for _, end, _ in results) - min(start for start, _, _ in results)
        if spread > self.max_spread:
            self.counts["view_skewed"] += 1
            return
        in_use = 0
        for url, view in zip(routers, views, strict=True):
            assert view is not None
            wallet = (view.get("wallets") or {}).get(self.model)
            if not wallet:
                continue
            in_use += int(wallet["in_use"])
            if int(wallet["budget"]) > self.budget:
                self._violate(f"{url} uses a budget of {wallet['budget']}, not {self.budget}")
        self.counts["view_samples"] += 1
        self.worst.in_use = max(self.worst.in_use, in_use)
        self.worst.spread = max(self.worst.spread, spread)
        if in_use > self.budget:
            self._violate(
                f"the routers have {in_use} credits in use at once of a {self.budget} budget "
                f"(views fetched within {spread * 1000:.1f} ms)"
            )

    # -- invariant 2 --------------------------------------------------------------------------

    def check_rates(self) -> None:
        with self._lock:
            answers = list(self.answers)
        for key, limit in self.rate_limits.items():
            mine = [a for a in answers if a.key == key]
            admitted, bound = worst_window(mine, limit, self.site_routers)
            self.worst.admitted[key], self.worst.allowed[key] = admitted, bound
            if admitted > bound:
                self._violate(
                    f"key {key}: {admitted} requests admitted in one minute, over the bound "
                    f"of {bound} (limit {limit} per minute, {self.site_routers} routers)"
                )

    # -- invariant 3 --------------------------------------------------------------------------

    def answered_tokens(self, key: str) -> int:
        with self._lock:
            return sum(a.tokens for a in self.answers if a.key == key and a.admitted)

    def stored_tokens(self, key: str) -> int:
        """The key's settled tokens in the store, summed over routers and dates."""
        # "{site}" with one primary, "{site/N}" on a cluster (docs/site.md, key layout)
        pattern = f"hivenet:{{{self.site}*:day:*:{quote(key, safe='')}"
        total = 0
        with self._client(timeout=1.0) as client:
            names = list(itertools.islice(client.scan_iter(match=pattern, count=1000), 100))
            for name in names:
                fields: dict[str, str] = client.hgetall(name)
                total += sum(int(v) for f, v in fields.items() if IN_FLIGHT not in f)
        return total

    def verify_daily(self, keys: Iterable[str], timeout: float = 6.0) -> None:
        """After the settle: wait (bounded) until the store's totals equal what the clients
        were answered with, and record a violation when they do not."""
        keys = list(keys)
        deadline = time.monotonic() + timeout
        seen: dict[str, int] = {}
        for _ in range(int(timeout / 0.1) + 1):
            for key in keys:
                try:
                    seen[key] = self.stored_tokens(key)
                except (valkey.ValkeyError, OSError):
                    with contextlib.suppress(Exception):  # tried again below
                        self.store_addr(refresh=True)
            if all(seen.get(k) == self.answered_tokens(k) for k in keys):
                break
            if time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        for key in keys:
            answered, stored = self.answered_tokens(key), seen.get(key, -1)
            self.daily[key] = {"answered": answered, "stored": stored}
            if stored != answered:
                self._violate(
                    f"key {key}: the store's daily total is {stored} tokens, the clients were "
                    f"answered with {answered}"
                )
            limit = self.daily_limits.get(key)
            if limit is not None:
                self.daily[key]["limit"] = limit
                if answered > limit:
                    self._violate(f"key {key}: {answered} tokens answered of a {limit} daily limit")

    # -- invariant 4 ---------------------------------------------------------------------------

    def check_latency(self) -> None:
        with self._lock:
            slow = [a for a in self.answers if a.status != 0 and a.latency > self.latency_bound]
        recorded = self.server_latency() if slow and self.server_latency is not None else {}
        confirmed = 0
        for answer in slow:
            inside = recorded.get(answer.request_id, answer.latency)
            self.worst.router_latency = max(self.worst.router_latency, inside)
            if inside > self.latency_bound:
                confirmed += 1
                self._violate(
                    f"a request to {answer.router} waited {answer.latency:.3f}s at the client "
                    f"and {inside:.3f}s in the router (status {answer.status}), over the "
                    f"{self.latency_bound:.3f}s bound"
                )
        self.slow = {"at_client": len(slow), "at_router": confirmed}

    def check_rounds(self, metrics: dict[str, str]) -> None:
        """`metrics`: each router's /metrics page, by a name for the report."""
        name = "hivenet_sync_round_duration_seconds"
        for router, text in metrics.items():
            count = metric(text, name + "_count") or 0.0
            total = metric(text, name + "_sum") or 0.0
            within = metric(text, name + "_bucket", le=repr(self.round_bound)) or 0.0
            slow = count - within
            self.rounds[router] = {
                "rounds": count,
                "mean_s": round(total / count, 4) if count else 0.0,
                "over_bound": slow,
            }
            if not count:
                self._violate(f"{router} reports no sync round at all")
            if slow:
                self._violate(f"{router}: {slow:.0f} sync rounds took over {self.round_bound}s")

    # -- the result ---------------------------------------------------------------------------

    def report(self) -> dict[str, Any]:
        """Runs the rate and latency checks (once) and sums everything up."""
        if not self._checked:
            self._checked = True
            self.check_rates()
            self.check_latency()
        with self._lock:
            answers = list(self.answers)
        statuses: dict[str, dict[str, int]] = {}
        for answer in answers:
            mine = statuses.setdefault(answer.key, {})
            mine[str(answer.status)] = mine.get(str(answer.status), 0) + 1
        latencies = sorted(a.latency for a in answers if a.status != 0)
        median = latencies[len(latencies) // 2] if latencies else 0.0
        return {
            **self.counts,
            "store_down_samples": dict(self.store_down),
            "requests": len(answers),
            "statuses": statuses,
            "budget": self.budget,
            "worst_store_held": self.worst.pool_held,
            "worst_in_use": self.worst.in_use,
            "worst_view_spread_ms": round(self.worst.spread * 1000, 1),
            "admitted_per_minute": dict(self.worst.admitted),
            "admitted_bound": dict(self.worst.allowed),
            "median_latency_s": round(median, 3),
            "worst_latency_s": round(self.worst.latency, 3),
            "latency_bound_s": round(self.latency_bound, 3),
            "over_bound": dict(self.slow),
            "worst_router_latency_of_those_s": round(self.worst.router_latency, 3),
            "daily": dict(self.daily),
            "rounds": dict(self.rounds),
            "violations": list(self.violations),
        }

    def assert_ok(self, min_store_samples: int = 10, min_view_samples: int = 10) -> None:
        """Call after report(), which runs the rate and latency checks."""
        assert not self.violations, "\n".join(self.violations[:20])
        assert self.counts["store_samples"] >= min_store_samples, self.counts
        assert self.counts["view_samples"] >= min_view_samples, self.counts
