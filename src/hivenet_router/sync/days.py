"""A round's writes and reads of the daily hashes (sync/daily.py), as few commands as fit.

Each call is one script (store.WRITE_DAYS or store.READ_DAYS) over up to `store.BATCH`
hashes: a round with thousands of changed keys sends a few commands instead of two per key
(the client's work per command is what such a round spent its time on). The keys of one
call share a hash slot on a Valkey Cluster (store.Keys groups them), so each call runs on
one primary. Calls go out `PIPELINE_CALLS` to a pipeline, so that no single send is so
large that the store, busy with the calls before it, lets the socket time out.

Order matters for exactness, and the round keeps it: a router's hash writes complete before
its usage entry is added (a reader that sees the entry then finds the total in the hash, or
counts it twice until its next read, never not at all), and a router reads hashes only
after the stream (what it read there is in the hashes it reads next).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hivenet_router.sync import store
from hivenet_router.sync.daily import DailyWrite
from hivenet_router.sync.store import BadReply, Keys

DAY_TTL = 2 * 86_400
PIPELINE_CALLS = 10  # script calls sent in one pipeline

Call = tuple[object, ...]  # one command's arguments: EVAL, the script, its keys and values


@dataclass(frozen=True, slots=True)
class Reads:
    """The hash reads of a round: one call per group of keys."""

    calls: list[Call]
    keys: list[list[str]]  # the keys each call reads, in order


def write_calls(keys: Keys, me: str, in_flight: str, writes: Sequence[DailyWrite]) -> list[Call]:
    """One WRITE_DAYS call per batch of `writes` (this router's fields; every write renews
    the hash's expiry, also of a hash the store lost)."""
    names = [keys.day(write.day, write.key) for write in writes]
    calls: list[Call] = []
    for group in keys.batches(names):
        values: list[int] = []
        for index in group:
            values += (writes[index].settled, writes[index].held)
        group_names = (names[index] for index in group)
        calls.append(
            ("EVAL", store.WRITE_DAYS, len(group), *group_names, me, in_flight, DAY_TTL, *values)
        )
    return calls


def read_calls(keys: Keys, day: str, budget_keys: Sequence[str]) -> Reads:
    """One READ_DAYS call per batch of the hashes of `budget_keys` today."""
    names = [keys.day(day, key) for key in budget_keys]
    calls: list[Call] = []
    groups: list[list[str]] = []
    for group in keys.batches(names):
        calls.append(("EVAL", store.READ_DAYS, len(group), *(names[index] for index in group)))
        groups.append([budget_keys[index] for index in group])
    return Reads(calls, groups)


Hashes = list[tuple[str, dict[bytes, bytes]]]  # budget key, its hash's fields


def hashes(replies: Sequence[object], keys: Sequence[list[str]]) -> Hashes:
    """READ_DAYS replies, each checked, as (budget key, its hash's fields)."""
    out: Hashes = []
    for reply, group in zip(replies, keys, strict=True):
        items = store.as_list(reply, "daily reads")
        if not items or store.as_bytes(items[0], "daily reads") != store.SCRIPT_TAG:
            raise BadReply(f"daily reads: expected {store.SCRIPT_TAG!r} first")
        if len(items) != len(group) + 1:
            raise BadReply(f"daily reads: {len(items) - 1} hashes for {len(group)} keys")
        for key, fields in zip(group, items[1:], strict=True):
            out.append((key, store.pairs(fields, "daily hash")))
    return out


def queue(pipe: Any, calls: Sequence[Call]) -> None:
    for call in calls:
        pipe.execute_command(*call)


async def run(client: Any, calls: Sequence[Call]) -> list[Any]:
    """Send `calls`, a pipeline at a time; their replies in order."""
    replies: list[Any] = []
    for start in range(0, len(calls), PIPELINE_CALLS):
        async with client.pipeline(transaction=False) as pipe:
            queue(pipe, calls[start : start + PIPELINE_CALLS])
            replies += await pipe.execute(raise_on_error=True)
    return replies
