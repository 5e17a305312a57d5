"""What a router's site membership shows: its metrics snapshot and GET /admin/sync."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hivenet_router.observability.sync_metrics import SyncSnapshot
from hivenet_router.sync.health import ROUND_BUCKETS

if TYPE_CHECKING:
    from hivenet_router.sync.site import Site


def snapshot(site: Site) -> SyncSnapshot:
    health = site.health
    since = health.last_ok or site.started
    return SyncSnapshot(
        peers=max(0, len(site.live) - (site.me in site.live)),
        min_routers=site.config.sync_min_routers,
        store_up=site.synced,
        settling=site.settling(),
        lag=max(0.0, site.clock.monotonic() - since),
        bounds=ROUND_BUCKETS,
        durations=tuple(health.durations),
        duration_sum=health.duration_sum,
        errors=dict(health.errors),
        grants=dict(site.credits.grants),
        acks=dict(site.credits.acks),
        held=tuple((model, wallet.held) for model, wallet in site.credits.wallets.items()),
        given_up=health.given_up,
        store_losses=health.store_losses,
    )


def view(site: Site) -> dict[str, Any]:
    """GET /admin/sync: what this router knows of its site, for operators and checkers."""
    now = site.clock.monotonic()
    return {
        "router_id": site.me,
        "site": site.config.site,
        "store_up": site.synced,
        "ever_synced": site.ever_synced,
        "fenced": site.fenced,
        "share": site.share(),
        "settle_seconds_left": max(0.0, site.settle_until - now),
        "lag_seconds": round(max(0.0, now - (site.health.last_ok or site.started)), 3),
        "routers": sorted(site.live),
        "wallets": {
            model: {
                "held": wallet.held,
                "in_use": site.credits.held(model),
                "budget": wallet.budget,
                "acknowledged": wallet.acked,
            }
            for model, wallet in site.credits.wallets.items()
        },
        "errors": dict(site.health.errors),
        "gave_up": site.health.gave_up_others,
        "rounds": site.health.rounds,
    }
