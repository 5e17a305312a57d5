"""A router's membership in a site: the sync round, and the state ports it feeds.

Every --sync-interval one round, in two round trips, from a background task:

1. the ROUND script: heartbeat (with the advertised address and the models whose wallet
   came back short), the server's time, the store's epoch (a store that lost its data has
   a new one: the settle window opens) and every router's heartbeat;
2. one pipeline: this router's usage since the last round as one stream entry (none when
   it admitted nothing), the others' new entries, its daily totals that changed, the daily
   hashes of the keys it serves, what each wallet holds, and (with Sentinel) a WAIT for a
   replica's acknowledgement.

The request path never waits on any of it (except the first daily read of a key; see
sync/daily.py). When a round fails, the router goes on alone on its share: budgets divided
by the routers it last saw live (at least --sync-min-routers).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from valkey.exceptions import ValkeyError

from hivenet_router.clock import Clock
from hivenet_router.config.router import RouterConfig
from hivenet_router.domain.site import SiteDirectory, SiteRouter
from hivenet_router.observability.sync_metrics import SyncSnapshot
from hivenet_router.router.admission import Ports
from hivenet_router.state.local import LocalLease, LocalPool
from hivenet_router.sync import store
from hivenet_router.sync.credits import CreditPool, Grant
from hivenet_router.sync.daily import IN_FLIGHT, DailyWrite, SiteDaily
from hivenet_router.sync.rates import SiteRates
from hivenet_router.sync.store import BadReply, Keys

log = logging.getLogger("hivenet_router.sync")

STREAM_KEEP_MS = 120_000  # usage entries older than this are trimmed
READ_BATCH = 10_000
DAY_TTL = 2 * 86_400
ACK_TIMEOUT_MS = 100
SETTLE_MARGIN = 15.0  # seconds past the request timeout that the settle window lasts
ROUND_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
RATE_COUNTERS = ("q", "i", "o")  # requests, input tokens, output tokens per minute


@dataclass(slots=True)
class Peer:
    router_id: str
    seen_ms: int  # server time of its last heartbeat
    info: dict[str, Any]


@dataclass(slots=True)
class Health:
    """What the metrics and /admin/sync read."""

    rounds: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    durations: list[int] = field(default_factory=lambda: [0] * (len(ROUND_BUCKETS) + 1))
    duration_sum: float = 0.0
    last_ok: float = 0.0  # monotonic time of the last good round (0: never)
    given_up: int = 0
    gave_up_others: int = 0
    store_losses: int = 0

    def observe(self, seconds: float) -> None:
        self.rounds += 1
        self.duration_sum += seconds
        for index, bound in enumerate(ROUND_BUCKETS):
            if seconds <= bound:
                self.durations[index] += 1
                return
        self.durations[-1] += 1

    def error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1


class SharePool(LocalPool):
    """A per-key share (B4) kept in memory: its budget divided by the live routers."""

    def __init__(self, clock: Clock, share: Callable[[], int]) -> None:
        super().__init__(clock, alone_fits=False)
        self._share = share

    async def reserve(
        self, key: str, amount: int, budget: int, wait: float, most: int = 0
    ) -> LocalLease | None:
        share = max(1, self._share())
        divided = budget // share if budget else 0
        if budget and not divided:
            return None  # a share below one token: nothing fits (0 would mean no limit)
        most = math.ceil(most / share) if most else 0
        return await super().reserve(key, amount, divided, wait, most)


class Site:
    """This router in its site: the store connection, the round, and the shared ports."""

    def __init__(self, config: RouterConfig, clock: Clock, directory: SiteDirectory) -> None:
        self.config = config
        self.clock = clock
        self.directory = directory
        self.me = directory.me.router_id
        self.keys = Keys(config.site)
        self.client: Any
        self.client, self.sentinel = store.connect(config)
        self.incarnation = secrets.token_hex(6)
        self._incarnation_bytes = self.incarnation.encode()
        self._me_bytes = self.me.encode()
        self.health = Health()
        self._started = clock.monotonic()
        self.epoch = ""
        self.synced = False
        self.ever_synced = False
        self.fenced = False
        self.live: dict[str, Peer] = {}  # heartbeats of the last few rounds
        self.members: dict[str, Peer] = {}  # every heartbeat in the store (not given up)
        self.last_live = 1
        self.settle_until = 0.0  # monotonic
        self.empty_elsewhere: set[str] = set()
        self._stream_from = ""
        self._pool_lock = asyncio.Lock()  # grants and the rounds' pool writes, one at a time
        self._round_number = 0
        self._missed = False  # a round failed since the last good one
        self._beats: dict[str, int] = {}  # every heartbeat in the store: router ID to server ms
        # What the agents this router hears from say: the router IDs each has a session
        # with (None for an agent that does not say). Set by the wiring.
        self.reports: Callable[[], list[tuple[str, ...] | None]] = list
        self._outage_logged = False
        self.settle_window = config.request_timeout + SETTLE_MARGIN
        self.rates = SiteRates(clock, self.share, config.rpm_burst_seconds)
        self.input_rates = SiteRates(clock, self.share)
        self.output_rates = SiteRates(clock, self.share, check_share=False)
        self.daily = SiteDaily(
            clock,
            self.me,
            self._read_day,
            lambda: self.synced,
            self.share,
            self.settling,
            self.incarnations,
        )
        self.credits = CreditPool(
            clock,
            self._grant,
            self.share,
            self._credits_usable,
            lambda: self.synced,
            starving=lambda model: model in self.empty_elsewhere,
        )
        self.shares = SharePool(clock, self.share)

    def ports(self) -> Ports:
        return Ports(
            rates=self.rates,
            daily=self.daily,
            input_rates=self.input_rates,
            output_rates=self.output_rates,
            occupancy=self.credits,
            shares=self.shares,
        )

    # -- what admission asks ----------------------------------------------------------------

    def share(self) -> int:
        """How many routers every budget is divided between now: every router whose
        heartbeat is in the store (one cut off from the store, or gone but not given up,
        may still be spending its share; only giving it up removes it)."""
        if self.synced:
            return max(1, len(self.members))
        return max(self.last_live, self.config.sync_min_routers, 1)

    def settling(self) -> bool:
        return self.clock.monotonic() < self.settle_until

    def incarnations(self) -> dict[bytes, bytes]:
        """Live router ID to the random ID of its current process."""
        return {
            peer.router_id.encode(): str(peer.info.get("inc", "")).encode()
            for peer in self.members.values()
        }

    def _credits_usable(self) -> bool:
        return self.ever_synced and not self.fenced

    def on_registration(self, change: str, record: object) -> None:
        """An agent (re)connected while the store cannot be reached: it may have told the
        other routers this one was gone, and they may have taken its credits back."""
        if change in {"registered", "updated"} and self.ever_synced and not self.synced:
            if not self.fenced:
                log.warning(
                    "an agent connected while the site store is unreachable: no occupancy "
                    "admission on this router until the store answers"
                )
            self.fenced = True

    # -- the loop ---------------------------------------------------------------------------

    async def run(self) -> None:
        """Rounds until cancelled; `leave` afterwards hands the credits back."""
        interval = self.config.sync_interval
        if self.config.sync_min_routers == 1:
            log.warning(
                "--sync-min-routers is 1: a router started while the store is unreachable "
                "enforces every limit alone; set it to the number of routers of the site"
            )
        for _ in range(1 << 30):  # until the store answers: the old credits must go first
            if await self._quietly(self._leave_previous()):
                break
            await asyncio.sleep(interval)
        while True:
            started = time.perf_counter()
            await self._quietly(self.round())
            self.health.observe(time.perf_counter() - started)
            await asyncio.sleep(max(0.05, interval - (time.perf_counter() - started)))

    async def _quietly(self, step: Any) -> bool:
        """Run one store step; any failure is counted and logged, never fatal to the loop."""
        try:
            await step
        except asyncio.CancelledError:
            raise
        except BadReply as error:
            self._failed("bad_reply", error)
            return False
        except (ValkeyError, OSError, TimeoutError) as error:
            self._failed("unreachable", error)
            return False
        except Exception as error:  # a bug, or a reply no reader foresaw: keep syncing
            log.exception("sync round failed unexpectedly")
            self._failed("internal", error)
            return False
        return True

    def _failed(self, kind: str, error: BaseException) -> None:
        self.health.error(kind)
        self.synced = False
        self._missed = True
        if not self._outage_logged:
            self._outage_logged = True
            log.warning(
                "site store %s (%s): this router admits on its share (1/%d of each budget) "
                "until it answers",
                "answered with something unexpected" if kind == "bad_reply" else "unreachable",
                str(error)[:200],
                self.share(),
            )

    async def _leave_previous(self) -> None:
        """A router restarting under the same ID holds nothing: return what its previous
        process held."""
        await self._give_up(self.me, oldest_ms=1 << 62)

    async def leave(self) -> None:
        """Shutdown: write what was settled since the last round, hand every credit back
        and stop counting as live."""
        self.credits.cancel()
        try:
            async with asyncio.timeout(1.0):
                await self._flush()
                await self._give_up(self.me, oldest_ms=1 << 62)
        except (ValkeyError, OSError, TimeoutError, BadReply) as error:
            log.info("could not leave the site cleanly (%s); the others give it up", error)
        with contextlib.suppress(ValkeyError, OSError):
            await self.client.aclose()

    async def _flush(self) -> None:
        """The last usage and daily totals of this process (requests ended since the last
        round, those the shutdown cut included), so the site and a restart count them."""
        pending = {name: counter.take_pending() for name, counter in self._rates().items()}
        writes = self.daily.writes()
        usage = self._usage_entry(pending, writes)
        in_flight = f"{self.me}{IN_FLIGHT}{self.incarnation}"
        async with self.client.pipeline(transaction=False) as pipe:
            for write in writes:
                name = self.keys.day(write.day, write.key)
                pipe.execute_command("HSET", name, self.me, write.settled, in_flight, write.held)
                pipe.execute_command("EXPIRE", name, DAY_TTL)
            if usage is not None:
                pipe.execute_command(
                    "XADD", self.keys.usage, "*", "r", self.me, "p", self.incarnation, "u", usage
                )
            await pipe.execute(raise_on_error=True)

    async def _give_up(self, router_id: str, oldest_ms: int) -> bool:
        reply = await self.client.execute_command(
            "EVAL", store.GIVE_UP, 2, self.keys.routers, self.keys.pools, router_id, oldest_ms
        )
        return bool(store.as_int(store.tagged(reply, "give-up", 2)[1], "give-up"))

    # -- one round --------------------------------------------------------------------------

    async def round(self) -> None:
        now_ms = await self._heartbeat()
        await self._give_up_the_gone(now_ms)
        self._round_number += 1
        pending = {name: counter.take_pending() for name, counter in self._rates().items()}
        writes = self.daily.writes()
        refresh = self.daily.to_refresh(self._round_number)
        try:
            # What a wallet holds is written under the pool lock: a grant running between
            # computing it and writing it would otherwise be overwritten with less than the
            # router holds, and the pool would hand that part out twice.
            async with self._pool_lock:
                holdings = self.credits.maintain(self.empty_elsewhere, self.settling())
                results, reads_at = await self._exchange(now_ms, pending, writes, refresh, holdings)
        except BaseException:
            for name, counter in self._rates().items():
                counter.give_back(pending[name])
            self.daily.rewrite(writes)
            self.daily.reread(refresh)
            raise
        self._absorb(results, reads_at, refresh)
        self.credits.handed_back(holdings)
        self._succeeded()

    async def _give_up_the_gone(self, now_ms: int) -> None:
        """Give up a router whose heartbeat stopped when no agent this router hears from
        still has a session with it: nothing can be running through it, so the credits it
        held go back to the pool. A router some agent still reaches keeps them (it may be
        serving while cut off from the store)."""
        after_ms = int(max(5 * self.config.sync_interval, 5.0) * 1000)
        stale = [
            router
            for router, stamp in self._beats.items()
            if router != self.me and now_ms - stamp > after_ms
        ]
        if not stale:
            return
        reports = [report for report in self.reports() if report is not None]
        if not reports:
            return  # no agent says: keep its credits, the budget stays safe
        for router in stale:
            if any(router in report for report in reports):
                continue
            if await self._give_up(router, oldest_ms=now_ms - after_ms):
                self.health.gave_up_others += 1
                log.warning(
                    "gave router %s up: no heartbeat for %.0fs and no agent reaches it; "
                    "its credits return to the site",
                    router,
                    (now_ms - self._beats[router]) / 1000,
                )

    def _rates(self) -> dict[str, SiteRates]:
        return {"q": self.rates, "i": self.input_rates, "o": self.output_rates}

    async def _heartbeat(self) -> int:
        info = orjson.dumps(
            {
                "addr": self.directory.me.addr,
                "peer": self.directory.me.peer_id,
                "inc": self.incarnation,
                "empty": self.credits.empty(),
            }
        ).decode()
        reply = await self.client.execute_command(
            "EVAL",
            store.ROUND,
            2,
            self.keys.routers,
            self.keys.meta,
            self.me,
            info,
            self.epoch,
            secrets.token_hex(8),
            int(self.settle_window * 1000),
        )
        parts = store.tagged(reply, "round", 6)
        now_ms = store.as_int(parts[1], "server time")
        epoch = store.as_bytes(parts[2], "epoch").decode()
        settle_ms = store.as_int(parts[3], "settle deadline")
        previous = store.as_bytes(parts[4], "own heartbeat")
        beats = store.pairs(parts[5], "heartbeats")
        if self.epoch and epoch != self.epoch:
            self._store_lost()
        elif self.ever_synced and not previous:
            self._given_up()
        elif self.ever_synced and self.incarnation.encode() not in previous:
            self.health.error("duplicate_router_id")
            log.error(
                "another router process heartbeats as --router-id %s: give every router "
                "of the site its own ID (two with one ID share, and break, its credits)",
                self.me,
            )
        self.epoch = epoch
        self.settle_until = self.clock.monotonic() + max(0, settle_ms - now_ms) / 1000
        self._peers(beats, now_ms)
        if not self._stream_from:
            self._stream_from = f"{max(0, now_ms - 60_000)}-0"
        return now_ms

    def _peers(self, beats: dict[bytes, bytes], now_ms: int) -> None:
        window_ms = int(max(3 * self.config.sync_interval, 3.0) * 1000)
        members: dict[str, Peer] = {}
        self._beats = {}
        for raw_id, raw in beats.items():
            stamp_text, _, info_text = raw.partition(b" ")
            if not stamp_text.isdigit():
                self.health.error("bad_entry")
                continue
            router, stamp = raw_id.decode(errors="replace"), int(stamp_text)
            self._beats[router] = stamp
            try:
                info = orjson.loads(info_text) if info_text else {}
            except orjson.JSONDecodeError:
                info = {}
            members[router] = Peer(router, stamp, info if isinstance(info, dict) else {})
        self.members = members
        self.live = {k: p for k, p in members.items() if now_ms - p.seen_ms <= window_ms}
        self.last_live = max(1, len(members))
        self.empty_elsewhere = {
            str(model)
            for peer in self.live.values()
            if peer.router_id != self.me and isinstance(peer.info.get("empty"), list)
            for model in peer.info["empty"]
        }
        self.directory.update(
            SiteRouter(peer.router_id, str(peer.info.get("peer", "")), str(peer.info["addr"]))
            for peer in self.live.values()
            if peer.router_id != self.me and isinstance(peer.info.get("addr"), str)
        )

    async def _exchange(
        self,
        now_ms: int,
        pending: dict[str, dict[str, float]],
        writes: list[DailyWrite],
        refresh: list[str],
        holdings: dict[str, int],
    ) -> tuple[list[Any], int]:
        """One pipeline; the replies, without the XADD's, and where the hash reads start."""
        keys, usage = self.keys, self._usage_entry(pending, writes)
        commands = 0
        async with self.client.pipeline(transaction=False) as pipe:
            # The totals first, then the entry announcing the change: a router reading
            # between the two counts it twice until its next read, never not at all.
            in_flight = f"{self.me}{IN_FLIGHT}{self.incarnation}"
            for write in writes:
                name = keys.day(write.day, write.key)
                pipe.execute_command("HSET", name, self.me, write.settled, in_flight, write.held)
                commands += 1
                if write.expire:
                    pipe.execute_command("EXPIRE", name, DAY_TTL)
                    commands += 1
            if usage is not None:
                pipe.execute_command(
                    "XADD", keys.usage, "MINID", "~", now_ms - STREAM_KEEP_MS, "*",
                    "r", self.me, "p", self.incarnation, "u", usage,
                )  # fmt: skip
                commands += 1
            pipe.execute_command(
                "XREAD", "COUNT", READ_BATCH, "STREAMS", keys.usage, self._stream_from
            )
            day = self.daily.day()
            for key in refresh:
                pipe.execute_command("HGETALL", keys.day(day, key))
            for model, held in holdings.items():
                if held:
                    pipe.execute_command("HSET", keys.pool(model), self.me, held)
                    pipe.execute_command("SADD", keys.pools, keys.pool(model))
                else:
                    pipe.execute_command("HDEL", keys.pool(model), self.me)
            if self.sentinel:
                pipe.execute_command("WAIT", 1, ACK_TIMEOUT_MS)
            results: list[Any] = await pipe.execute(raise_on_error=True)
        return results[commands:], 1  # from XREAD on; the hash reads follow it

    @staticmethod
    def _usage_entry(
        pending: dict[str, dict[str, float]], writes: list[DailyWrite]
    ) -> bytes | None:
        """This round's stream entry: rate spend per counter and daily changes per day;
        None when there is nothing to say."""
        usage: dict[str, Any] = {name: spent for name, spent in pending.items() if spent}
        daily: dict[str, dict[str, int]] = {}
        for write in writes:
            if write.delta:
                daily.setdefault(write.day, {})[write.key] = write.delta
        if daily:
            usage["d"] = daily
        return orjson.dumps(usage) if usage else None

    def _absorb(self, results: list[Any], reads_at: int, refresh: list[str]) -> None:
        entries = store.stream_entries(results[0])
        for ident, fields in entries:
            self._stream_from = ident.decode()
            if fields.get(b"p") == self._incarnation_bytes:
                continue  # this process's own spend (a previous process's counts)
            mine = fields.get(b"r") == self._me_bytes  # its daily totals came from the hash
            self._subtract(fields.get(b"u", b""), daily=not mine)
        live = self.incarnations()
        reads = results[reads_at : reads_at + len(refresh)]
        for key, fields in zip(refresh, reads, strict=True):
            self.daily.absorb(key, store.pairs(fields, "daily hash"), live)
        if self.sentinel and store.as_int(results[-1], "WAIT") >= 1:
            self.credits.acknowledged()

    def _subtract(self, raw: bytes, daily: bool = True) -> None:
        try:
            usage = orjson.loads(raw)
        except orjson.JSONDecodeError:
            self.health.error("bad_entry")
            return
        if not isinstance(usage, dict):
            self.health.error("bad_entry")
            return
        counters = self._rates()
        changes = usage.pop("d", None)
        if daily:
            self._add_daily(changes)
        for name, spent in usage.items():
            counter = counters.get(name)
            if counter is None or not isinstance(spent, dict):
                continue
            for key, amount in spent.items():
                if isinstance(amount, int | float) and math.isfinite(amount):
                    counter.subtract(str(key), float(amount))

    def _add_daily(self, daily: object) -> None:
        if not isinstance(daily, dict):
            return
        for day, changes in daily.items():
            if not isinstance(changes, dict):
                self.health.error("bad_entry")
                continue
            for key, delta in changes.items():
                if isinstance(delta, int) and not isinstance(delta, bool):
                    self.daily.add_foreign(str(day), str(key), delta)

    def _succeeded(self) -> None:
        if not self.synced and self._outage_logged:
            log.info("site store answers again: %d routers live", len(self.live))
        self._outage_logged = False
        if self._missed:
            # Usage entries may have been trimmed unread meanwhile: read every followed
            # key's totals again next round.
            self._missed = False
            self.daily.reread()
        self.synced = True
        self.ever_synced = True
        self.fenced = False
        self.health.last_ok = self.clock.monotonic()
        for counter in self._rates().values():
            counter.rebalance()
        self.daily.synced_now()

    def _store_lost(self) -> None:
        self.health.store_losses += 1
        log.warning(
            "the site store lost its data: totals and credits are written again; no new "
            "credits for %.0fs (the settle window)",
            self.settle_window,
        )
        self.daily.store_lost()

    def _given_up(self) -> None:
        self.health.given_up += 1
        log.warning("the other routers gave this router up: its credits are gone, asking again")
        self.credits.drop_credits()

    # -- views ------------------------------------------------------------------------------

    def snapshot(self) -> SyncSnapshot:
        health = self.health
        since = health.last_ok or self._started
        return SyncSnapshot(
            peers=max(0, len(self.live) - (self.me in self.live)),
            min_routers=self.config.sync_min_routers,
            store_up=self.synced,
            settling=self.settling(),
            lag=max(0.0, self.clock.monotonic() - since),
            bounds=ROUND_BUCKETS,
            durations=tuple(health.durations),
            duration_sum=health.duration_sum,
            errors=dict(health.errors),
            grants=dict(self.credits.grants),
            acks=dict(self.credits.acks),
            held=tuple((model, wallet.held) for model, wallet in self.credits.wallets.items()),
            given_up=health.given_up,
            store_losses=health.store_losses,
        )

    def view(self) -> dict[str, Any]:
        """GET /admin/sync: what this router knows of its site, for operators and checkers."""
        now = self.clock.monotonic()
        return {
            "router_id": self.me,
            "site": self.config.site,
            "store_up": self.synced,
            "ever_synced": self.ever_synced,
            "fenced": self.fenced,
            "share": self.share(),
            "settle_seconds_left": max(0.0, self.settle_until - now),
            "lag_seconds": round(max(0.0, now - (self.health.last_ok or self._started)), 3),
            "routers": sorted(self.live),
            "wallets": {
                model: {
                    "held": wallet.held,
                    "in_use": self.credits.held(model),
                    "budget": wallet.budget,
                    "acknowledged": wallet.acked,
                }
                for model, wallet in self.credits.wallets.items()
            },
            "errors": dict(self.health.errors),
            "gave_up": self.health.gave_up_others,
            "rounds": self.health.rounds,
        }

    # -- store reads for the ports ----------------------------------------------------------

    async def _read_day(self, day: str, key: str) -> dict[bytes, bytes]:
        reply = await self.client.execute_command("HGETALL", self.keys.day(day, key))
        return store.pairs(reply, "daily hash")

    async def _grant(self, model: str, wanted: int, budget: int) -> Grant | None:
        keys = self.keys
        try:
            async with self._pool_lock, self.client.pipeline(transaction=False) as pipe:
                pipe.execute_command(
                    "EVAL",
                    store.GRANT,
                    4,
                    keys.pool(model),
                    keys.meta,
                    keys.routers,
                    keys.pools,
                    self.me,
                    wanted,
                    budget,
                    self.epoch,
                )
                if self.sentinel:
                    pipe.execute_command("WAIT", 1, ACK_TIMEOUT_MS)
                results = await pipe.execute(raise_on_error=True)
            parts = store.tagged(results[0], "grant", 4)
            held = store.as_int(parts[1], "grant held")
            granted = store.as_int(parts[2], "grant")
            if held == -1:
                return None  # the store lost its data since the last round: ask after it
            acked = not self.sentinel or store.as_int(results[1], "WAIT") >= 1
        except BadReply as error:
            self._failed("bad_reply", error)
            return None
        except (ValkeyError, OSError, TimeoutError) as error:
            self._failed("unreachable", error)
            return None
        if held < 0 or granted < 0 or granted > wanted:
            self._failed("bad_reply", BadReply(f"grant of {granted} (held {held})"))
            return None
        return Grant(held, granted, acked)
