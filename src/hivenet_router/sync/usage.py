"""Today's daily-token totals of the whole site, for `GET /admin/usage`.

The site already shares them (sync/daily.py): one hash per budget key and day, each
router's settled tokens under its router ID and what its current process holds in flight
under "ID~incarnation". Here every hash of the day is read (SCAN over the day's keys, on
every primary of a cluster; then HGETALL each, pipelined) and
summed per router, counting in-flight fields as the budgets do: only a live router's
current process. This router's own figures come from its counter, not from the store,
which has them up to one sync round late.
"""

from __future__ import annotations

from typing import Any

from valkey.asyncio.cluster import ValkeyCluster

from hivenet_router.sync import store
from hivenet_router.sync.daily import IN_FLIGHT
from hivenet_router.sync.store import Keys

SCAN_COUNT = 500  # keys a SCAN step looks at: an admin read, never on the request path


async def read_day(client: Any, keys: Keys, day: str) -> dict[str, dict[bytes, bytes]]:
    """Every budget key's hash of `day`, by budget key."""
    pattern = keys.day_pattern(day)
    names: list[bytes] = []
    if isinstance(client, ValkeyCluster):
        async for name in client.scan_iter(match=pattern, count=SCAN_COUNT):
            names.append(store.as_bytes(name, "daily key"))
    else:
        cursor = 0
        while True:
            reply = store.as_list(
                await client.execute_command("SCAN", cursor, "MATCH", pattern, "COUNT", SCAN_COUNT),
                "daily scan",
                2,
            )
            cursor = store.as_int(reply[0], "daily scan cursor")  # the client may parse it
            found = store.as_list(reply[1], "scan")
            names.extend(store.as_bytes(name, "daily key") for name in found)
            if cursor == 0:
                break
    names = sorted(set(names))
    if not names:
        return {}
    async with client.pipeline(transaction=False) as pipe:
        for name in names:
            pipe.execute_command("HGETALL", name)
        replies = await pipe.execute(raise_on_error=True)
    return {
        keys.budget_key(name, day): store.pairs(reply, "daily hash")
        for name, reply in zip(names, replies, strict=True)
    }


def by_router(
    hashes: dict[str, dict[bytes, bytes]],
    live: dict[bytes, bytes],
    me: str,
    own: dict[str, int],
) -> dict[str, dict[str, int]]:
    """Budget key to router ID to tokens (settled, plus in flight on a live process).
    `own`: this router's totals as its counter has them; they replace its stored fields (a
    key it has not read since a restart keeps what the store has)."""
    out: dict[str, dict[str, int]] = {}
    for key, fields in hashes.items():
        shares: dict[str, int] = {}
        for field, value in fields.items():
            if not value.isdigit():
                continue  # malformed: its owner rewrites it next round
            owner, mark, incarnation = field.partition(IN_FLIGHT.encode())
            if mark and live.get(owner) != incarnation:
                continue  # held by a process that is gone
            router = owner.decode(errors="replace")
            shares[router] = shares.get(router, 0) + int(value)
        out[key] = shares
    for key, used in own.items():
        out.setdefault(key, {})[me] = used
    return out
