"""Heartbeats and usage entries as other routers wrote them: malformed parts are skipped
and reported, never applied."""

from __future__ import annotations

import orjson

from hivenet_router.sync.daily import DailyWrite
from hivenet_router.sync.entries import apply_usage, read_heartbeats, usage_entry


class Spent:
    def __init__(self) -> None:
        self.seen: dict[str, float] = {}

    def subtract(self, key: str, amount: float) -> None:
        self.seen[key] = self.seen.get(key, 0.0) + amount


def test_heartbeats_with_a_bad_stamp_are_skipped_and_counted() -> None:
    members, bad = read_heartbeats(
        {b"a": b'1000 {"addr": "h:1"}', b"b": b"soon {}", b"c": b"2000 not-json"}
    )
    assert sorted(members) == ["a", "c"] and bad == 1
    assert members["a"].info == {"addr": "h:1"} and members["c"].info == {}


def test_an_entry_round_trips_rates_and_daily_changes() -> None:
    writes = [DailyWrite("2026-12-01", "team", 10, 5, 15)]
    raw = usage_entry({"q": {"team": 2.0}, "i": {}}, writes)
    assert raw is not None and orjson.loads(raw) == {
        "q": {"team": 2.0},
        "d": {"2026-12-01": {"team": 15}},
    }
    rates, added = Spent(), []
    assert apply_usage(raw, {"q": rates}, lambda day, key, delta: added.append((key, delta)))
    assert rates.seen == {"team": 2.0} and added == [("team", 15)]
    assert usage_entry({"q": {}}, []) is None  # nothing to say: no entry


def test_malformed_entries_apply_nothing_they_cannot_read() -> None:
    rates, added = Spent(), []

    def add(day: str, key: str, delta: int) -> None:
        added.append((key, delta))

    assert not apply_usage(b"{not json", {"q": rates}, add)
    assert not apply_usage(b"[1, 2]", {"q": rates}, add)
    raw = orjson.dumps({"q": {"k": "x", "j": float("inf"), "n": 1}, "d": {"day": [1]}})
    assert not apply_usage(raw, {"q": rates}, add)
    assert rates.seen == {"n": 1.0} and added == []
    # a router's own earlier entries: rates applied, daily changes skipped
    raw = orjson.dumps({"q": {"n": 1}, "d": {"day": {"k": 5}}})
    assert apply_usage(raw, {"q": rates}, None) and added == []
