"""Routers of one site on a Valkey Cluster (3 primaries, 3 replicas; --sync-cluster),
driven by the SDK: the same limits as on one primary, and a primary killed under load."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import valkey
from valkey.cluster import ClusterNode

from tests.integration.test_site import ask, site_of
from tests.integration.test_site_faults import (
    LOAD,
    MODEL,
    RATED,
    SITE,
    ago,
    checker_for,
    finish,
    load,
    mixed,
    store_up,
    two_router_site,
)
from tests.procs import Cluster, metric, sync_view, wait_until
from tests.site_checker import CLUSTER
from tests.valkey_cluster import ValkeyCluster

pytestmark = pytest.mark.timeout(240)

POOL = "hivenet:{test-site}:pool:m"  # the control slot: heartbeats, stream, pools


@pytest.fixture
def store(tmp_path: Path) -> Iterator[ValkeyCluster]:
    with ValkeyCluster(tmp_path / "cluster") as running:
        yield running


def client_of(store: ValkeyCluster) -> Any:
    ports = [int(addr.rsplit(":", 1)[1]) for addr in store.seeds]
    nodes = [ClusterNode("127.0.0.1", port) for port in ports]  # type: ignore[no-untyped-call]
    return valkey.ValkeyCluster(startup_nodes=nodes, socket_timeout=2)


def test_two_routers_enforce_one_request_rate_on_a_cluster(
    make_cluster: Cluster, tmp_path: Path, store: ValkeyCluster
) -> None:
    routers = site_of(make_cluster, tmp_path, store, "{requests_per_minute: 20}", "")
    answered = sum(ask(routers[attempt % 2]) for attempt in range(60))
    print(f"answered {answered} of 60 requests against a site limit of 20 per minute")
    assert 15 <= answered <= 30
    assert all(sync_view(router)["store_up"] for router in routers)


def test_a_killed_primary_keeps_credits_within_the_budget(
    make_cluster: Cluster, tmp_path: Path, store: ValkeyCluster
) -> None:
    """The primary of the control slot is killed while requests run: its replica takes
    over, both routers sync again, and the credits held never exceed the budget."""
    # A budget the load fills: 32 requests at once want more than it holds.
    routers = site_of(make_cluster, tmp_path, store, "{}", "admit_budget_tokens: 100\n")
    budget = int(0.9 * 100)  # admit fraction x budget x one replica
    samples, worst = 0, 0

    def sample(client: Any) -> None:
        nonlocal samples, worst
        try:
            held = client.hvals(POOL)
        except valkey.ValkeyError:
            return  # the slot is moving
        total = sum(int(value) for value in held)
        worst, samples = max(worst, total), samples + 1
        assert total <= budget, f"routers hold {total} credits of a {budget} budget"

    client = client_of(store)
    with ThreadPoolExecutor(32) as pool:  # more than the budget holds at once
        before = [pool.submit(ask, routers[index % 2]) for index in range(128)]
        for _ in range(20):
            sample(client)
        killed = store.kill_primary_for(POOL)  # while those requests run
        print(f"killed the primary on port {killed}")
        client.close()
        client = client_of(store)
        while not all(future.done() for future in before):
            sample(client)
        for router in routers:
            wait_until(lambda r=router: sync_view(r)["store_up"] is True, timeout=20)
        after = [pool.submit(ask, routers[index % 2]) for index in range(64)]
        while not all(future.done() for future in after):
            sample(client)
        answered = sum(future.result() for future in after)
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline:
        sample(client)
    client.close()
    print(f"{samples} samples of the pool; at most {worst} of {budget} credits held")
    assert samples > 0 and answered > 0


def test_primary_killed_on_a_cluster(make_cluster: Cluster, tmp_path: Path) -> None:
    """The same on a Valkey Cluster of 3 primaries and 3 replicas (--sync-cluster): the
    primary of the site's control slot (heartbeats, stream, pools) is killed and its
    replica takes over; the checker's invariants hold throughout."""
    with ValkeyCluster(tmp_path / "cluster") as store:
        nodes = ["--sync-cluster", ",".join(store.seeds)]
        site = two_router_site(make_cluster, tmp_path, [nodes, nodes])
        pool = f"hivenet:{{{SITE}}}:pool:{MODEL}"
        with (
            checker_for(site, lambda: CLUSTER + ",".join(store.seeds)) as checker,
            load(checker, mixed(site.routers)),
        ):
            time.sleep(2.0)
            began = time.monotonic()
            old = store.kill_primary_for(pool)
            print(f"primary on port {old} killed; its replica serves after {ago(began)}")
            for router in site.routers:
                wait_until(
                    lambda r=router: store_up(r), timeout=max(0.5, 15 - (time.monotonic() - began))
                )
            print(f"both routers synced again {ago(began)} after the kill")
            time.sleep(2.0)
        answered_after = [a for a in checker.answers if a.started > began + 1 and a.status == 200]
        assert answered_after, "no request was answered after the failover"
        for index, router in enumerate(site.routers):
            acked = metric(router.metrics(), "hivenet_sync_grant_acks_total", result="acked")
            print(f"r{index}: grant acks {acked}, store errors {sync_view(router)['errors']}")
            assert (acked or 0) > 0, "no grant was acknowledged by a replica"
        finish(checker, site, [LOAD.owner, RATED.owner])
