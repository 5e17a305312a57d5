"""`GET /admin/usage` on a site of two routers sharing a real valkey-server: every router
answers with the site's totals and each router's share, not only its own."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2 as httpx
import pytest

from tests.integration.test_site import KEY, MODEL, site_of
from tests.procs import ADMIN_KEY, Cluster, Router, wait_until
from tests.valkey_site import ValkeySite


@pytest.fixture
def valkey(tmp_path: Path) -> Iterator[ValkeySite]:
    with ValkeySite(tmp_path / "valkey", replicas=0, sentinels=0) as site:
        yield site


def usage(router: Router) -> dict[str, Any]:
    reply = httpx.get(
        router.url + "/admin/usage", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=5
    )
    assert reply.status_code == 200, reply.text
    body: dict[str, Any] = reply.json()
    return body


def spend(router: Router) -> int:
    with router.openai(KEY) as client:
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
    assert reply.usage is not None
    return reply.usage.total_tokens


def test_every_router_shows_the_sites_totals_and_each_routers_share(
    make_cluster: Cluster, tmp_path: Path, valkey: ValkeySite
) -> None:
    routers = site_of(make_cluster, tmp_path, valkey, "{tokens_per_day: 100000}", "")
    spent = {"r0": 0, "r1": 0}
    for attempt in range(6):
        spent[f"r{attempt % 2}"] += spend(routers[attempt % 2])
    want = {"tenant": "acme", "model": None, "tokens_used": sum(spent.values()), "routers": spent}

    def site_wide(router: Router) -> bool:
        body = usage(router)
        return body["scope"] == "site" and body["budgets"] == [want]

    for router in routers:  # the other router's share reaches the store within a round
        wait_until(lambda r=router: site_wide(r), timeout=10)
    # stopped, a router's settled tokens still count for the site, under its ID
    routers[1].proc.stop()
    assert usage(routers[0])["budgets"] == [want]
