"""The site's sync on a Valkey Cluster of 3 primaries and 3 replicas: the two-router tests
of test_site.py again (imported here, so they run with this module's `flushed`: the
cluster), the key layout, and a primary killed under the routers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hivenet_router.sync.store import SHARDS, Keys
from tests.unit.sync.test_site import (  # noqa: F401 (collected here, on the cluster)
    CLUSTER,
    Maker,
    make,
    rounds,
    store,
    test_a_day_hash_the_store_lost_expires_when_written_again,
    test_a_given_up_router_drops_its_credits,
    test_a_key_that_changed_is_read_again_within_the_refresh_rounds,
    test_a_restart_whose_first_read_fails_does_not_write_over_the_day,
    test_a_restarted_router_counts_what_it_settled_today,
    test_a_restarted_router_does_not_publish_its_old_total_again,
    test_a_round_reads_no_hash_of_a_key_nobody_changed,
    test_a_router_alone_in_its_rounds_gets_its_share_only,
    test_a_router_no_agent_reaches_is_given_up_after_its_heartbeat_stops,
    test_a_router_that_leaves_has_its_in_flight_dropped_from_idle_keys,
    test_a_store_that_lost_its_data_opens_the_settle_window,
    test_an_empty_wallet_makes_the_others_keep_no_more_than_their_share,
    test_credits_never_exceed_the_budget_across_routers,
    test_daily_totals_are_read_once_then_followed_each_round,
    test_debt_on_one_router_refuses_the_key_on_the_other,
    test_leaving_writes_what_was_settled_since_the_last_round,
    test_request_rates_are_shared_and_never_exceed_the_limit_plus_a_round,
    test_streamed_growth_counts_in_the_store_but_is_not_credit,
    test_two_processes_with_one_router_id_are_reported,
    test_while_another_router_starves_a_router_admits_its_share_only,
    test_while_the_store_settles_a_wallet_keeps_what_it_holds,
    test_without_agent_reports_nobody_is_given_up,
)
from tests.valkey_cluster import ValkeyCluster

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ValkeyCluster]:
    with ValkeyCluster(tmp_path_factory.mktemp("cluster")) as running:
        yield running


@pytest.fixture
def flushed(cluster: ValkeyCluster) -> str:
    cluster.flush()
    return CLUSTER + ",".join(cluster.seeds)


def test_daily_hashes_spread_over_shards_and_batches_keep_to_one_slot() -> None:
    keys = Keys("s", sharded=True)
    names = [keys.day("2026-12-07", f"tenant-{n}") for n in range(5000)]
    tags = {name[name.index("{") : name.index("}") + 1] for name in names}
    assert len(tags) == SHARDS
    assert keys.routers.startswith("hivenet:{s}:")  # the control keys keep one slot
    for group in keys.batches(names):
        assert len({names[i][: names[i].index("}")] for i in group}) == 1
    assert keys.budget_key(names[7].encode(), "2026-12-07") == "tenant-7"
    plain = Keys("s")
    assert plain.day("2026-12-07", "a b") == "hivenet:{s}:day:2026-12-07:a%20b"


async def test_the_site_usage_reads_every_shard(make: Maker) -> None:  # noqa: F811
    a = make("a")
    await rounds(a)
    for n in range(200):
        assert (await a.daily.charge(f"tenant-{n}", 10, 1000)).ok
    await rounds(a)
    totals = await a.usage(a.daily.day(), {})
    assert len(totals) == 200 and totals["tenant-42"] == {"a": 10}


async def test_a_primary_killed_under_the_routers_keeps_the_budget(
    make: Maker,  # noqa: F811
    cluster: ValkeyCluster,
    tmp_path: Path,
) -> None:
    """The primary holding the control slot (heartbeats, pools) dies: its replica takes
    over, the rounds come back, and the routers' credits never exceed the budget."""
    a, b = make("a"), make("b")
    await rounds(a, b, a, b)
    leases: list[Any] = []
    for site in (a, b):
        for _ in range(3):
            lease = await site.credits.reserve("m", 20, 100, 0.5)
            if lease is not None:
                leases.append(lease)
    assert (await a.daily.charge("team", 300, 1000)).ok
    assert (await b.daily.charge("team", 10, 1000)).ok
    await rounds(a, b)
    assert 4 <= len(leases) <= 5  # of 20 each, a budget of 100
    cluster.kill_primary_for(a.keys.routers)
    for _ in range(50):  # rounds fail until the client finds the new primary
        ok = [await site._quietly(site.round()) for site in (a, b)]
        if all(ok):
            break
    assert a.synced and b.synced
    await rounds(a, b)
    held = {k.decode(): int(v) for k, v in store(cluster_addr(cluster)).hgetall(
        a.keys.pool("m")).items()}  # fmt: skip
    assert sum(held.values()) <= 100
    for site in (a, b, a, b):  # whatever is left, after the failover
        lease = await site.credits.reserve("m", 20, 100, 0.3)
        if lease is not None:
            leases.append(lease)
        await rounds(site)
    assert len(leases) * 20 <= 100
    assert await a.daily.left("team", 1000) == await b.daily.left("team", 1000) == 690
    for lease in leases:
        lease.release()


def cluster_addr(cluster: ValkeyCluster) -> str:
    return CLUSTER + ",".join(cluster.seeds)
