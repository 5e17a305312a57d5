"""Two routers' sync state against a real valkey-server, driven round by round."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import valkey
from valkey.cluster import ClusterNode

from hivenet_router.clock import SystemClock
from hivenet_router.config.router import RouterConfig
from hivenet_router.domain.site import SiteDirectory, SiteRouter
from hivenet_router.sync import daily
from hivenet_router.sync.daily import REFRESH_ROUNDS
from hivenet_router.sync.site import Site

Maker = Callable[..., Site]


@pytest.fixture
async def make(flushed: str) -> AsyncIterator[Maker]:
    made: list[Site] = []

    def build(name: str, addr: str = flushed, **overrides: object) -> Site:
        if addr.startswith(CLUSTER):  # the same tests on a cluster (test_site_cluster.py)
            overrides["sync_cluster"] = tuple(addr.removeprefix(CLUSTER).split(","))
        else:
            overrides["sync_addr"] = addr
        config = RouterConfig(
            sync_store="valkey",
            router_id=name,
            **overrides,  # type: ignore[arg-type]
        )
        config.validate()
        site = Site(config, SystemClock(), SiteDirectory(SiteRouter(name, "peer", "")))
        made.append(site)
        return site

    yield build
    for site in made:
        site.credits.cancel()
        await site.client.aclose()


async def rounds(*sites: Site) -> None:
    for site in sites:
        await site.round()


CLUSTER = "cluster:"  # an address that names a cluster's nodes: "cluster:HOST:PORT,..."


def store(addr: str) -> Any:
    if addr.startswith(CLUSTER):
        nodes = [node.rsplit(":", 1) for node in addr.removeprefix(CLUSTER).split(",")]
        return valkey.ValkeyCluster(
            startup_nodes=[ClusterNode(host, int(port)) for host, port in nodes]  # type: ignore[no-untyped-call]
        )
    host, port = addr.split(":")
    return valkey.Valkey(host=host, port=int(port))


async def test_request_rates_are_shared_and_never_exceed_the_limit_plus_a_round(
    make: Maker,
) -> None:
    a, b = make("a"), make("b")
    await rounds(a, b, a, b)
    assert a.share() == b.share() == 2
    admitted = 0
    for _ in range(6):  # six rounds, both routers greedy
        for site in (a, b):
            while (await site.rates.charge("tenant", 1, 60)).ok:
                admitted += 1
                assert admitted < 200, "a charge never refused"
        await rounds(a, b)
    # A round reads what the others published before it, not what they admit after: one
    # round of the other router's share can go unseen (60 + 60 / 2 at most).
    assert 55 <= admitted <= 90
    print(f"admitted {admitted} of a 60-per-minute limit across two routers")


async def test_a_router_alone_in_its_rounds_gets_its_share_only(make: Maker) -> None:
    a, b = make("a"), make("b")
    await rounds(a, b, a)
    taken = 0
    while (await a.rates.charge("k", 1, 100)).ok:
        taken += 1
    assert taken == 50


async def test_daily_totals_are_read_once_then_followed_each_round(make: Maker) -> None:
    a, b = make("a"), make("b")
    await rounds(a, b, a, b)
    assert (await a.daily.charge("team", 100, 150)).ok
    await a.daily.settle("team", 100, 40)
    await rounds(a)
    # b's first request for the key reads a's total (40 settled)
    assert not (await b.daily.charge("team", 120, 150)).ok
    assert (await b.daily.charge("team", 100, 150)).ok
    await rounds(b, a)
    # a now sees b's 100 in flight: 150 - 40 - 100 = 10 left
    assert await a.daily.left("team", 150) == 10
    await b.daily.settle("team", 100, 0)  # b's request answered nothing
    await rounds(b, a)
    assert await a.daily.left("team", 150) == 110


async def restarted(make: Maker, charged: int, spent: int) -> Site:
    """Router "a" settles `spent` of "team"'s daily 100, then starts again under its ID."""
    a = make("a")
    await rounds(a)
    assert (await a.daily.charge("team", charged, 100)).ok
    await a.daily.settle("team", charged, spent)
    await rounds(a)
    again = make("a")  # same --router-id, new process
    await rounds(again)
    return again


async def test_a_restarted_router_counts_what_it_settled_today(make: Maker, flushed: str) -> None:
    again = await restarted(make, 50, 30)
    assert not (await again.daily.charge("team", 80, 100)).ok
    assert (await again.daily.charge("team", 70, 100)).ok


async def test_credits_never_exceed_the_budget_across_routers(make: Maker, flushed: str) -> None:
    a, b = make("a"), make("b")
    await rounds(a, b, a, b)
    first = await a.credits.reserve("m", 60, 100, 5.0)
    assert first is not None
    second = await b.credits.reserve("m", 60, 100, 0.3)
    assert second is None  # only 40 were free
    held = {k.decode(): int(v) for k, v in store(flushed).hgetall(a.keys.pool("m")).items()}
    assert held and sum(held.values()) <= 100
    first.release()
    await rounds(a, b)  # a keeps its headroom only
    third = await b.credits.reserve("m", 60, 100, 5.0)
    assert third is not None
    held = {k.decode(): int(v) for k, v in store(flushed).hgetall(a.keys.pool("m")).items()}
    assert sum(held.values()) <= 100
    third.release()


async def test_an_empty_wallet_makes_the_others_keep_no_more_than_their_share(
    make: Maker,
) -> None:
    a, b = make("a"), make("b")
    await rounds(a, b, a, b)
    lease = await a.credits.reserve("m", 70, 100, 5.0)
    assert lease is not None
    assert await b.credits.reserve("m", 45, 100, 0.2) is None  # short: flags it
    await rounds(b, a)
    assert "m" in a.empty_elsewhere
    lease.release()
    await rounds(a)
    assert a.credits.wallets["m"].held == 50  # its share; the rest went back to the pool
    again = await b.credits.reserve("m", 45, 100, 5.0)
    assert again is not None  # b gets its share now
    again.release()


async def test_while_another_router_starves_a_router_admits_its_share_only(
    make: Maker,
) -> None:
    a, b = make("a"), make("b")
    await rounds(a, b, a, b)
    first = await a.credits.reserve("m", 80, 100, 5.0)
    assert first is not None
    assert await b.credits.reserve("m", 30, 100, 0.2) is None  # b's wallet comes back empty
    await rounds(b, a)
    first.release()
    # a still holds the 80 it was granted, but while b starves it admits its half only
    assert a.credits.wallets["m"].held >= 80
    assert await a.credits.reserve("m", 60, 100, 0.1) is None
    second = await a.credits.reserve("m", 50, 100, 5.0)
    assert second is not None
    second.release()


async def test_a_given_up_router_drops_its_credits(make: Maker, flushed: str) -> None:
    a, b = make("a"), make("b")
    await rounds(a, b, a, b)
    lease = await a.credits.reserve("m", 30, 100, 5.0)
    assert lease is not None
    assert await b._give_up("a", oldest_ms=1 << 62)
    await rounds(a)
    assert a.health.given_up == 1
    assert a.credits.wallets["m"].held == 0  # its credits are gone: it asks again
    assert store(flushed).hget(a.keys.pool("m"), "a") == b"30"  # what runs still counts
    lease.release()


async def test_streamed_growth_counts_in_the_store_but_is_not_credit(
    make: Maker, flushed: str
) -> None:
    a, b = make("a"), make("b")
    await rounds(a, b, a, b)
    lease = await a.credits.reserve("m", 50, 100, 5.0)
    assert lease is not None
    granted = a.credits.wallets["m"].held
    lease.grow(40)  # streamed output past what was granted
    await rounds(a)
    assert store(flushed).hget(a.keys.pool("m"), "a") == b"90"
    assert a.credits.wallets["m"].held <= granted
    lease.release()
    # the growth is gone: only what the pool grants can be admitted again
    held = {k.decode(): int(v) for k, v in store(flushed).hgetall(a.keys.pool("m")).items()}
    assert sum(held.values()) <= 100


async def test_a_store_that_lost_its_data_opens_the_settle_window(
    make: Maker, flushed: str
) -> None:
    a = make("a", request_timeout=5.0)
    await rounds(a, a)
    assert (await a.daily.charge("known", 10, 100)).ok
    store(flushed).flushall()
    await rounds(a)
    assert a.settling() and a.health.store_losses == 1
    assert not (await a.daily.charge("new-key", 10, 100)).ok
    assert (await a.daily.charge("known", 10, 100)).ok
    assert await a.credits.reserve("m", 10, 100, 0.3) is None  # no grants while settling


async def test_an_unreachable_store_leaves_each_router_its_share(make: Maker) -> None:
    lone = make("a", addr="127.0.0.1:9", sync_min_routers=4)
    await lone._quietly(lone.round())
    assert not lone.synced and lone.health.errors["unreachable"] == 1
    taken = 0
    while (await lone.rates.charge("k", 1, 100)).ok:
        taken += 1
    assert taken == 25
    assert await lone.credits.reserve("m", 1, 100, 0.1) is None  # never synced: no credits


@contextlib.asynccontextmanager
async def store_answering(reply: bytes) -> AsyncIterator[int]:
    """A stand-in store on loopback that answers every command with `reply`: its port."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await reader.read(65536):
            writer.write(reply)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()


async def test_garbage_from_the_store_is_an_error_not_a_permission(make: Maker) -> None:
    async with store_answering(b"*2\r\n$5\r\nhello\r\n:7\r\n") as port:
        odd = make("a", addr=f"127.0.0.1:{port}")
        assert not await odd._quietly(odd.round())
        assert odd.health.errors.get("bad_reply") == 1
        assert await odd.credits.reserve("m", 1, 100, 0.1) is None


@pytest.mark.parametrize(
    "refusal", [b"-NOAUTH Authentication required.\r\n", b"-WRONGPASS invalid password\r\n"]
)
async def test_a_store_refusing_the_credentials_is_said_at_error_until_it_stops(
    make: Maker, refusal: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    """A wrong password file ran as an outage: one WARNING, and nothing after (found by a
    new user). It is a mistake to fix: an ERROR naming the flag, once a minute."""

    async with store_answering(refusal) as port:
        locked = make("a", addr=f"127.0.0.1:{port}")
        assert not await locked._quietly(locked.round())
        assert not await locked._quietly(locked.round())
        assert locked.health.errors.get("refused") == 2
        said = [r for r in caplog.records if "refuses this router's credentials" in r.message]
        assert len(said) == 1 and said[0].levelname == "ERROR"
        assert "--sync-password-file" in said[0].message


async def test_a_router_no_agent_reaches_is_given_up_after_its_heartbeat_stops(
    make: Maker, flushed: str
) -> None:
    a, b = make("a"), make("b")
    await rounds(a, b, a, b)
    lease = await a.credits.reserve("m", 40, 100, 5.0)
    assert lease is not None
    store(flushed).hset(a.keys.routers, "a", "1 {}")  # a's heartbeat stopped long ago
    b.reports = lambda: [("a", "b")]  # an agent still reaches a: keep its credits
    await rounds(b)
    assert b.health.gave_up_others == 0
    b.reports = lambda: [("b",), None]  # nobody reaches a any more
    await rounds(b)
    assert b.health.gave_up_others == 1
    assert store(flushed).hget(a.keys.pool("m"), "a") is None  # its credits are back
    await rounds(a)
    assert a.health.given_up == 1
    lease.release()


async def test_without_agent_reports_nobody_is_given_up(make: Maker, flushed: str) -> None:
    a, b = make("a"), make("b")
    await rounds(a, b, a, b)
    store(flushed).hset(a.keys.routers, "a", "1 {}")
    await rounds(b)  # b's agents say nothing: a keeps its credits until it restarts
    assert b.health.gave_up_others == 0


async def test_a_key_that_changed_is_read_again_within_the_refresh_rounds(make: Maker) -> None:
    a, b = make("a"), make("b")
    await rounds(a, b, a, b)
    assert (await a.daily.charge("team", 30, 1000)).ok
    await a.daily.settle("team", 30, 30)
    assert (await b.daily.charge("team", 10, 1000)).ok  # b follows the key from here
    await rounds(a, b)
    assert await b.daily.left("team", 1000) == 960
    for _ in range(REFRESH_ROUNDS):
        await rounds(b)  # b's scheduled read of the key is behind it
    b.daily._keys["team"].others = 500  # as if an entry had been read twice
    assert (await a.daily.charge("team", 5, 1000)).ok
    await a.daily.settle("team", 5, 5)
    await rounds(a)  # a's entry: a change b reads the key's hash again for
    for _ in range(REFRESH_ROUNDS):
        await rounds(b)
    assert await b.daily.left("team", 1000) == 955


def hash_reads(addr: str) -> int:
    """HGETALL calls on the store (every node of a cluster), those of scripts included."""
    client = store(addr)
    if addr.startswith(CLUSTER):
        by_node = client.info("commandstats", target_nodes=valkey.ValkeyCluster.ALL_NODES)
        return sum(int(s.get("cmdstat_hgetall", {}).get("calls", 0)) for s in by_node.values())
    stats = client.info("commandstats")
    return int(stats.get("cmdstat_hgetall", {}).get("calls", 0))


async def test_a_round_reads_no_hash_of_a_key_nobody_changed(make: Maker, flushed: str) -> None:
    a, b = make("a"), make("b")
    await rounds(a, b, a, b)
    for n in range(50):
        assert (await a.daily.charge(f"key-{n}", 10, 1000)).ok
        assert (await b.daily.charge(f"key-{n}", 10, 1000)).ok
    for _ in range(REFRESH_ROUNDS + 2):
        await rounds(a, b)  # every changed key read again once (a sees b's entry a round late)
    before = hash_reads(flushed)
    for _ in range(2 * REFRESH_ROUNDS):
        await rounds(a, b)
    # Only the heartbeats, which the ROUND script reads once a round.
    assert hash_reads(flushed) - before == 2 * 2 * REFRESH_ROUNDS
    assert await b.daily.left("key-7", 1000) == 980


async def test_a_router_that_leaves_has_its_in_flight_dropped_from_idle_keys(
    make: Maker,
) -> None:
    a, b = make("a"), make("b")
    await rounds(a, b, a, b)
    assert (await a.daily.charge("team", 100, 1000)).ok  # in flight on a
    assert (await b.daily.charge("team", 10, 1000)).ok
    for _ in range(REFRESH_ROUNDS + 1):
        await rounds(a, b)
    assert await b.daily.left("team", 1000) == 890
    await a._give_up("a", oldest_ms=1 << 62)  # a's process is gone, its request with it
    for _ in range(REFRESH_ROUNDS + 1):
        await rounds(b)
    assert await b.daily.left("team", 1000) == 990


async def test_two_processes_with_one_router_id_are_reported(make: Maker) -> None:
    first, second = make("a"), make("a")
    await rounds(first, first, second, first)
    assert first.health.errors.get("duplicate_router_id") == 1


async def test_while_the_store_settles_a_wallet_keeps_what_it_holds(
    make: Maker, flushed: str
) -> None:
    a = make("a", request_timeout=5.0)
    await rounds(a, a)
    lease = await a.credits.reserve("m", 60, 100, 5.0)
    assert lease is not None
    held = a.credits.wallets["m"].held
    lease.release()
    store(flushed).flushall()
    await rounds(a, a)
    assert a.settling()
    assert a.credits.wallets["m"].held == held  # nothing handed back: none could come back
    again = await a.credits.reserve("m", 60, 100, 5.0)
    assert again is not None  # served before the loss: keeps serving on its wallet
    again.release()


async def test_a_failed_first_read_leaves_the_router_its_share(make: Maker) -> None:
    lone = make("a", addr="127.0.0.1:9", sync_min_routers=3)
    assert not (await lone.daily.charge("team", 400, 900)).ok  # over 900 / 3
    assert (await lone.daily.charge("team", 300, 900)).ok
    assert not (await lone.daily.charge("team", 1, 900)).ok


async def test_a_restarted_router_does_not_publish_its_old_total_again(make: Maker) -> None:
    a, b = make("a"), make("b")
    await rounds(a, b, a, b)
    assert (await a.daily.charge("team", 600, 1000)).ok
    await a.daily.settle("team", 600, 600)
    await rounds(a)
    assert (await b.daily.charge("team", 10, 1000)).ok  # b reads 600 for a
    again = make("a")
    await rounds(again, b)
    assert (await again.daily.charge("team", 10, 1000)).ok  # restores 600, publishes +10
    await rounds(again, b, b)
    assert await b.daily.left("team", 1000) == 1000 - 620


async def test_leaving_writes_what_was_settled_since_the_last_round(
    make: Maker, flushed: str
) -> None:
    a = make("a")
    await rounds(a, a)
    assert (await a.daily.charge("team", 50, 1000)).ok
    await a.daily.settle("team", 50, 20)
    await a.leave()
    fields = store(flushed).hgetall(a.keys.day(a.daily.day(), "team"))
    assert fields[b"a"] == b"20"
    assert store(flushed).hget(a.keys.routers, "a") is None  # no longer a member


async def test_a_request_cancelled_while_waiting_for_credits_leaves_nothing_behind(
    make: Maker,
) -> None:
    a, b = make("a"), make("b")
    await rounds(a, b, a, b)
    first = await b.credits.reserve("m", 100, 100, 0.5)  # b holds the whole budget
    assert first is not None
    waiting = asyncio.ensure_future(a.credits.reserve("m", 10, 100, 5.0))
    await asyncio.sleep(0.2)
    assert not waiting.done()  # in line, its grant refused
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    assert a.credits.held("m") == 0
    assert [level for level in a.credits.levels() if level[0] == "m"] == [("m", 0, 0)]
    first.release()


async def test_a_restart_whose_first_read_fails_does_not_write_over_the_day(
    make: Maker, flushed: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    again = await restarted(make, 90, 90)
    monkeypatch.setattr(daily, "FIRST_READ_TIMEOUT", 0)  # the store too slow to answer it
    assert (await again.daily.charge("team", 5, 100)).ok  # alone, within its share
    monkeypatch.undo()
    await again.daily.settle("team", 5, 5)
    await rounds(again, again)
    field = store(flushed).hget(again.keys.day(again.daily.day(), "team"), "a")
    assert field == b"95"  # what the first process settled, and this one's 5
    assert not (await again.daily.charge("team", 10, 100)).ok


async def test_a_day_hash_the_store_lost_expires_when_written_again(
    make: Maker, flushed: str
) -> None:
    a = make("a")
    await rounds(a)
    name = a.keys.day(a.daily.day(), "team")
    assert (await a.daily.charge("team", 10, 100)).ok
    await rounds(a)
    valkey_client = store(flushed)
    assert valkey_client.ttl(name) > 0
    valkey_client.delete(name)  # a failover to a replica that never had it
    assert (await a.daily.charge("team", 10, 100)).ok
    await rounds(a)
    assert valkey_client.exists(name) and valkey_client.ttl(name) > 0


async def test_debt_on_one_router_refuses_the_key_on_the_other(make: Maker) -> None:
    a, b = make("a"), make("b")
    await rounds(a, b, a, b)
    assert (await a.output_rates.charge("k", 40, 100)).ok
    await a.output_rates.adjust("k", 110, 100)  # 150 used of 100 a minute: 50 in debt
    assert await a.output_rates.left("k", 100) == pytest.approx(-50, abs=1)
    await rounds(a, b)
    assert await b.output_rates.left("k", 100) < 0
    assert not (await b.output_rates.charge("k", 1, 100)).ok


async def test_a_bucket_idle_for_rounds_gets_its_share_of_what_the_site_has_left(
    make: Maker,
) -> None:
    """The reset after each round is applied when a bucket is next used (a round costs
    nothing for idle keys); another router's spend in between still counts."""
    a, b = make("a"), make("b")
    await rounds(a, b, a, b)
    assert (await a.rates.charge("k", 1, 6000)).ok  # a follows the key: 5,999 left
    for _ in range(40):
        assert (await b.rates.charge("k", 50, 6000)).ok  # b spends 2,000 of its 3,000
    for _ in range(3):
        await rounds(b, a)  # a reads b's spend in the first; the key idle on a meanwhile
    taken = 0
    while (await a.rates.charge("k", 10, 6000)).ok:
        taken += 10
    # Its share: (6,000 - 1 - 2,000) / 2 plus what refilled meanwhile (100 a second).
    assert 1990 <= taken <= 2100


async def _spend_forty(a: Site, flushed: str) -> tuple[Any, str]:
    """Router `a` settles 40 tokens of team's day and writes them: the store's client and
    the day's key."""
    assert (await a.daily.charge("team", 50, 100)).ok
    await a.daily.settle("team", 50, 40)
    await rounds(a)
    return store(flushed), a.keys.day(a.daily.day(), "team")


async def test_after_an_outage_a_router_writes_its_totals_again(make: Maker, flushed: str) -> None:
    """A failover can promote a replica that missed writes it had acknowledged. Totals are
    written whole, only when they change: one nobody changes afterwards stayed lost, and
    the routers' /admin/usage (read from the store) disagreed for good (a flaky accounting
    check under a Sentinel failover)."""
    a = make("a")
    await rounds(a)
    valkey_client, name = await _spend_forty(a, flushed)
    written = valkey_client.hget(name, "a")
    assert written is not None and int(written) == 40
    valkey_client.hdel(name, "a")  # what the promoted replica never had
    a._failed("unreachable", OSError("failover"))
    await rounds(a)  # the store answers again
    await rounds(a)  # and today's totals go out again
    again = valkey_client.hget(name, "a")
    assert again is not None and int(again) == 40


def test_a_store_error_in_the_log_says_its_cause_not_the_clients_repr() -> None:
    """Wrong Sentinel addresses logged 200 characters of the client's repr and were cut
    before "connection refused" (found by a new user)."""
    from hivenet_router.sync.trouble import REASON_CHARS, reason

    pool = "<Valkey(<ConnectionPool(<Connection(host=127.0.0.1,port=1,db=0)>)>)>" * 3
    try:
        try:
            raise OSError("Error 111 connecting to 127.0.0.1:1. Connection refused.")
        except OSError as cause:
            raise RuntimeError(f"No master found for 'hivenet' : {pool} - see below") from cause
    except RuntimeError as error:
        said = reason(error)
    assert "Connection(" not in said and "Connection refused" in said
    assert said.startswith("No master found for 'hivenet' : ...")
    assert len(reason(RuntimeError("x" * 1000))) == REASON_CHARS


async def test_a_router_moved_to_another_primary_writes_its_totals_again(
    make: Maker, flushed: str
) -> None:
    """A Sentinel client follows a failover without an error when no command is under way
    at that moment (it opens a connection the Sentinels closed again, to the new primary),
    and keeps writing on a connection the failover left open to an old primary still
    answering, until the Sentinels make it a replica and discard those writes. No round
    failed, so nothing was written again, and the routers' /admin/usage disagreed for good
    (the accounting check under a second, spurious failover)."""
    a = make("a")
    pool = a.client.connection_pool
    pool.master_address = ("127.0.0.1", 1)  # as a Sentinel-managed pool names its primary
    await rounds(a)
    valkey_client, name = await _spend_forty(a, flushed)
    valkey_client.hdel(name, "a")  # the writes the old primary took, discarded
    pool.master_address = ("127.0.0.1", 2)  # the Sentinels named another primary
    await rounds(a)  # no error: the move is seen
    assert a.synced
    await rounds(a)  # and today's totals go out again
    again = valkey_client.hget(name, "a")
    assert again is not None and int(again) == 40
