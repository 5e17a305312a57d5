"""The site's daily totals by router, from the day hashes as the store holds them."""

from __future__ import annotations

from hivenet_router.sync.usage import by_router


def test_settled_and_live_in_flight_count_per_router_and_this_routers_own_wins() -> None:
    hashes = {
        "acme": {
            b"r0": b"100",  # this router's stored field: one round late
            b"r1": b"2080",
            b"r1~inc-now": b"30",  # held by r1's current process
            b"r2": b"50",
            b"r2~inc-old": b"999",  # held by a process of r2 that is gone
            b"r3": b"junk",  # malformed: counts nothing
        },
        "other\x00m": {b"r1": b"7"},
    }
    live = {b"r1": b"inc-now", b"r2": b"inc-new"}
    shares = by_router(hashes, live, "r0", {"acme": 2080, "new": 5})
    assert shares == {
        "acme": {"r0": 2080, "r1": 2110, "r2": 50},
        "other\x00m": {"r1": 7},
        "new": {"r0": 5},
    }
