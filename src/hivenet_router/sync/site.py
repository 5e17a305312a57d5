"""A router's membership in a site: the sync round, and the state ports it feeds.

Every --sync-interval one round, in two round trips, from a background task:

1. the ROUND script: heartbeat (with the advertised address and the models whose wallet
   came back short), the server's time, the store's epoch (a store that lost its data has
   a new one: the settle window opens) and every router's heartbeat;
2. one pipeline: this router's daily totals that changed (WRITE_DAYS scripts), its usage
   since the last round as one stream entry (none when it admitted nothing), the others'
   new entries, the daily hashes due to be read again (READ_DAYS scripts), what each
   wallet holds, and (with Sentinel or a cluster) a WAIT for a replica's
   acknowledgement. Large rounds, and every round on a cluster, send the daily writes
   before it and the reads after it (sync/days.py).

A round's work follows what changed since the last one (keys charged here, entries from
the others), not the keys followed: see sync/daily.py and sync/rates.py.

The request path never waits on any of it (except the first daily read of a key; see
sync/daily.py). When a round fails, the router goes on alone on its share: budgets divided
by the routers it last saw live (at least --sync-min-routers).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable
from typing import Any

import orjson
from valkey.exceptions import AuthenticationError, AuthorizationError, ValkeyError

from hivenet_router.clock import Clock
from hivenet_router.config.router import RouterConfig
from hivenet_router.domain.site import SiteDirectory, SiteRouter
from hivenet_router.observability.sync_metrics import SyncSnapshot
from hivenet_router.state.ports import Ports
from hivenet_router.sync import claim, days, store, usage, views
from hivenet_router.sync.credits import CreditPool, Grant
from hivenet_router.sync.daily import IN_FLIGHT, DailyWrite, SiteDaily
from hivenet_router.sync.entries import Peer, apply_usage, read_heartbeats, usage_entry
from hivenet_router.sync.health import Health
from hivenet_router.sync.rates import SiteRates
from hivenet_router.sync.shares import SharePool
from hivenet_router.sync.store import BadReply, Keys
from hivenet_router.sync.trouble import StoreTrouble, reason

log = logging.getLogger("hivenet_router.sync")

STREAM_KEEP_MS = 120_000  # usage entries older than this are trimmed
READ_BATCH = 10_000
ACK_TIMEOUT_MS = 100
SETTLE_MARGIN = 15.0  # seconds past the request timeout that the settle window lasts


class Site:
    """This router in its site: the store connection, the round, and the shared ports."""

    def __init__(self, config: RouterConfig, clock: Clock, directory: SiteDirectory) -> None:
        self.config = config
        self.clock = clock
        self.directory = directory
        self.me = directory.me.router_id
        self.client: Any
        self.client, self.kind = store.connect(config)
        self.keys = Keys(config.site, sharded=self.kind == "cluster")
        # With replicas behind it (Sentinel, a cluster), writes wait for one to acknowledge.
        self.acks = self.kind != "primary"
        # With one primary, the last batch of daily writes and the first reads ride in the
        # round's one pipeline; on a cluster they go to other primaries, before and after.
        self.inline_days = self.kind != "cluster"
        self.incarnation = secrets.token_hex(6)
        # Named in the heartbeat, so that a process refused its router ID can say whose it is.
        self._process: dict[str, object] = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "agents": str(config.grpc_port),
        }
        self._incarnation_bytes = self.incarnation.encode()
        self._me_bytes = self.me.encode()
        self.health = Health()
        self.started = clock.monotonic()
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
        self._primary: tuple[Any, Any] | None = None  # the Sentinels' pick, last good round
        # What the agents this router hears from say: the router IDs each has a session
        # with (None for an agent that does not say). Set by the wiring.
        self.reports: Callable[[], list[tuple[str, ...] | None]] = list
        self.trouble = StoreTrouble()  # what the log says of the store's failures
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
        except (AuthenticationError, AuthorizationError) as error:
            self._failed("refused", error)
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
        self.trouble.failed(kind, error, self.share())

    async def claimed_by(self) -> str | None:
        """Before joining: the live router process that already heartbeats under this
        router ID, in words (sync/claim.py); None when there is none, or when the store
        cannot say (the rounds then report a second process under this ID)."""
        window_ms = self._window_ms()
        try:
            async with asyncio.timeout(window_ms / 1000 + 5.0):
                return await claim.live_holder(self.client, self.keys, self.me, window_ms)
        except (ValkeyError, OSError, TimeoutError, BadReply, ValueError, TypeError) as error:
            # ValueError, TypeError: the client's own reply parsing (its TIME callback)
            # failing on a store that answers garbage.
            log.warning(
                "could not check in the site store that no other router process runs as "
                "--router-id %s (%s); starting",
                self.me,
                reason(error),
            )
            return None

    def _window_ms(self) -> int:
        """How long a router's heartbeat counts it as live."""
        return int(max(3 * self.config.sync_interval, 3.0) * 1000)

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
        await days.run(self.client, self._write_calls(writes))
        async with self.client.pipeline(transaction=False) as pipe:
            self._publish(pipe, pending, writes, trim_before_ms=0)
            await pipe.execute(raise_on_error=True)

    def _write_calls(self, writes: list[DailyWrite]) -> list[days.Call]:
        in_flight = f"{self.me}{IN_FLIGHT}{self.incarnation}"
        return days.write_calls(self.keys, self.me, in_flight, writes)

    def _publish(
        self,
        pipe: Any,
        pending: dict[str, dict[str, float]],
        writes: list[DailyWrite],
        trim_before_ms: int,
    ) -> int:
        """Queue the usage entry announcing this round's changes (after the daily totals it
        announces: sync/days.py); the stream is trimmed of entries older than
        `trim_before_ms` (0: not). Returns how many commands were queued."""
        usage = usage_entry(pending, writes)
        if usage is None:
            return 0
        trim = ("MINID", "~", trim_before_ms) if trim_before_ms else ()
        entry = ("r", self.me, "p", self.incarnation, "u", usage)
        pipe.execute_command("XADD", self.keys.usage, *trim, "*", *entry)
        return 1

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
        reads = days.read_calls(self.keys, self.daily.day(), refresh)
        # With one primary the last batch of writes and the first reads ride in the round's
        # one pipeline (two round trips in all at a small site); the rest goes before and
        # after it.
        inline = len(reads.calls) if self.inline_days else 0
        inline = min(inline, days.PIPELINE_CALLS)
        try:
            # What a wallet holds is written under the pool lock: a grant running between
            # computing it and writing it would otherwise be overwritten with less than the
            # router holds, and the pool would hand that part out twice.
            async with self._pool_lock:
                holdings = self.credits.maintain(self.empty_elsewhere, self.settling())
                results = await self._exchange(now_ms, pending, writes, reads, inline, holdings)
        except BaseException:
            for name, counter in self._rates().items():
                counter.give_back(pending[name])
            self.daily.rewrite(writes)
            self.daily.reread(refresh)
            raise
        self._absorb(results, days.hashes(results[1 : 1 + inline], reads.keys[:inline]))
        try:
            later = await days.run(self.client, reads.calls[inline:])
        except BaseException:
            self.daily.reread([key for group in reads.keys[inline:] for key in group])
            raise
        self._absorb_days(days.hashes(later, reads.keys[inline:]))
        self.credits.handed_back(holdings)
        primary = store.primary_of(self.client)
        moved = self._primary is not None and primary not in (None, self._primary)
        self._primary = primary or self._primary
        if moved:
            # Not one more command to the old primary: one a failover left up takes writes
            # until the Sentinels make it a replica, and they are gone then.
            await self.client.connection_pool.disconnect()
        self._succeeded(moved)

    async def _give_up_the_gone(self, now_ms: int) -> None:
        """Give up a router whose heartbeat stopped when no agent this router hears from
        still has a session with it: nothing can be running through it, so the credits it
        held go back to the pool. A router some agent still reaches keeps them (it may be
        serving while cut off from the store)."""
        after_ms = int(max(5 * self.config.sync_interval, 5.0) * 1000)
        stale = [
            router
            for router, peer in self.members.items()
            if router != self.me and now_ms - peer.seen_ms > after_ms
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
                    (now_ms - self.members[router].seen_ms) / 1000,
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
                **self._process,
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
        window_ms = self._window_ms()
        members, bad = read_heartbeats(beats)
        for _ in range(bad):
            self.health.error("bad_entry")
        before = self.incarnations()
        self.members = members
        after = self.incarnations()
        if any(after.get(router) != process for router, process in before.items()):
            self.daily.process_left()  # what it held in flight stops counting
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
        reads: days.Reads,
        inline: int,
        holdings: dict[str, int],
    ) -> list[Any]:
        """The daily writes, then one pipeline: the usage entry, the others' new entries,
        the first `inline` hash reads, the wallets' holdings and (with Sentinel) a WAIT.
        Its replies from the XREAD on."""
        keys = self.keys
        write_calls = self._write_calls(writes)
        last = write_calls[-1:] if self.inline_days else []
        await days.run(self.client, write_calls[: len(write_calls) - len(last)])
        control = await store.control_node(self.client, keys) if self.acks else {}
        async with self.client.pipeline(transaction=False) as pipe:
            days.queue(pipe, last)
            commands = len(last) + self._publish(pipe, pending, writes, now_ms - STREAM_KEEP_MS)
            pipe.execute_command(
                "XREAD", "COUNT", READ_BATCH, "STREAMS", keys.usage, self._stream_from
            )
            days.queue(pipe, reads.calls[:inline])
            for model, held in holdings.items():
                if held:
                    pipe.execute_command("HSET", keys.pool(model), self.me, held)
                    pipe.execute_command("SADD", keys.pools, keys.pool(model))
                else:
                    pipe.execute_command("HDEL", keys.pool(model), self.me)
            if self.acks:
                pipe.execute_command("WAIT", 1, ACK_TIMEOUT_MS, **control)
            results: list[Any] = await pipe.execute(raise_on_error=True)
        return results[commands:]

    def _absorb(self, results: list[Any], hashes: days.Hashes) -> None:
        entries = store.stream_entries(results[0])
        for ident, fields in entries:
            self._stream_from = ident.decode()
            if fields.get(b"p") == self._incarnation_bytes:
                continue  # this process's own spend (a previous process's counts)
            mine = fields.get(b"r") == self._me_bytes  # its daily totals came from the hash
            daily = None if mine else self.daily.add_foreign
            if not apply_usage(fields.get(b"u", b""), self._rates(), daily):
                self.health.error("bad_entry")
        self._absorb_days(hashes)
        if self.acks and store.as_int(results[-1], "WAIT") >= 1:
            self.credits.acknowledged()

    def _absorb_days(self, hashes: days.Hashes) -> None:
        live = self.incarnations()
        for key, fields in hashes:
            self.daily.absorb(key, fields, live)

    def _succeeded(self, moved: bool = False) -> None:
        """`moved`: the client follows another primary since the last good round. It
        follows a failover without an error when no command was under way at the wrong
        moment (it opens a connection the Sentinels closed again, to the new primary),
        and one the failover left open to an old primary that still answers takes writes
        there until the Sentinels make it a replica and discard them."""
        self.trouble.answered(len(self.live))
        if moved:
            log.warning("the site store's primary changed: today's totals are written again")
            self._missed = True  # and what the others wrote is read again
        if (moved or not self.synced) and self.ever_synced:
            # After an outage or a failover the store may have lost writes it had
            # acknowledged: a replica promoted before it had them, or an old primary that
            # took them after another was promoted. Totals are written whole, so writing
            # every one of today's again heals the store; a total nobody changes afterwards
            # would otherwise stay lost for good, and the routers' /admin/usage disagree.
            self.daily.store_lost()
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
        return views.snapshot(self)

    def view(self) -> dict[str, Any]:
        """GET /admin/sync: what this router knows of its site, for operators and checkers."""
        return views.view(self)

    async def usage(self, day: str, own: dict[str, int]) -> dict[str, dict[str, int]]:
        """GET /admin/usage: each budget's tokens today, by router (sync/usage.py)."""
        hashes = await usage.read_day(self.client, self.keys, day)
        return usage.by_router(hashes, self.incarnations(), self.me, own)

    # -- store reads for the ports ----------------------------------------------------------

    async def _read_day(self, day: str, key: str) -> dict[bytes, bytes]:
        reply = await self.client.execute_command("HGETALL", self.keys.day(day, key))
        return store.pairs(reply, "daily hash")

    async def _grant(self, model: str, wanted: int, budget: int) -> Grant | None:
        keys = self.keys
        try:
            control = await store.control_node(self.client, keys) if self.acks else {}
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
                if self.acks:
                    pipe.execute_command("WAIT", 1, ACK_TIMEOUT_MS, **control)
                results = await pipe.execute(raise_on_error=True)
            parts = store.tagged(results[0], "grant", 4)
            held = store.as_int(parts[1], "grant held")
            granted = store.as_int(parts[2], "grant")
            if held == -1:
                return None  # the store lost its data since the last round: ask after it
            acked = not self.acks or store.as_int(results[1], "WAIT") >= 1
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
