"""The site store: a Valkey primary (found directly or through Sentinel), its key names and
the scripts that change shared state atomically.

Nothing here runs on the request path: the sync loop (sync/site.py) and credit grants
(sync/credits.py) call it from background tasks. Every reply is checked before it is used:
a store that answers with something unexpected raises `BadReply`, which the callers count
and treat as "no answer", never as permission.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, unquote

import valkey.asyncio as valkey_asyncio
from valkey.asyncio.cluster import ClusterNode, ValkeyCluster
from valkey.asyncio.sentinel import Sentinel

from hivenet_router.config.options import read_secret_file
from hivenet_router.config.router import RouterConfig
from hivenet_router.config.values import host_port

SCRIPT_TAG = b"hivenet-sync-2"  # every script's reply starts with it
SHARDS = 32  # hash tags the daily hashes spread over on a Valkey Cluster
BATCH = 1000  # keys per WRITE_DAYS or READ_DAYS call: bounds how long one blocks the store
COMMAND_TIMEOUT = 0.5  # seconds: a round is retried next interval rather than waited on


class BadReply(Exception):
    """The store answered, but not with what this router's scripts return."""


@dataclass(frozen=True, slots=True)
class Keys:
    """Every key of one site. The control keys (heartbeats, epoch, usage stream, pools)
    share the hash tag `{site}`: one slot, so that each script that changes them runs on
    one primary. The daily hashes, one per budget key and day, are most of the keys and
    most of a round's work: with one primary they share that tag too; on a Valkey Cluster
    (`sharded`) each is under `{site/N}`, N one of SHARDS by its budget key, so that they
    spread over the cluster's primaries while a batch of one N stays in one slot."""

    site: str
    sharded: bool = False

    @property
    def prefix(self) -> str:
        return f"hivenet:{{{self.site}}}:"

    @property
    def routers(self) -> str:
        return self.prefix + "routers"  # hash: router ID -> "server-ms info-json"

    @property
    def meta(self) -> str:
        return self.prefix + "meta"  # hash: epoch, settle_until (server ms)

    @property
    def usage(self) -> str:
        return self.prefix + "usage"  # stream: one entry per router and round

    @property
    def pools(self) -> str:
        return self.prefix + "pools"  # set: every pool key ever used

    def pool(self, model: str) -> str:
        return self.prefix + "pool:" + quote(model, safe="")  # hash: router ID -> credits

    def day(self, date: str, budget_key: str) -> str:
        # hash: router ID -> settled tokens today; "router ID~" -> tokens held in flight
        quoted = quote(budget_key, safe="")
        if not self.sharded:
            return f"{self.prefix}day:{date}:{quoted}"
        shard = zlib.crc32(quoted.encode()) % SHARDS
        return f"hivenet:{{{self.site}/{shard}}}:day:{date}:{quoted}"

    def day_pattern(self, date: str) -> str:
        """A SCAN pattern that matches every daily hash of `date`."""
        head = f"hivenet:{{{self.site}" + ("}:" if not self.sharded else "/")
        tail = f"day:{date}:" if not self.sharded else f"}}:day:{date}:"
        middle = "" if not self.sharded else "*"
        return _glob_escape(head) + middle + _glob_escape(tail) + "*"

    def budget_key(self, name: bytes, date: str) -> str:
        """The budget key a daily hash of `date` is named for."""
        return unquote(name.decode().split(f":day:{date}:", 1)[1])

    def batches(self, names: Sequence[str]) -> list[list[int]]:
        """Positions of `names` grouped for one script call each: at most BATCH a call,
        and on a cluster one hash tag (one slot) a call."""
        groups: dict[str, list[int]] = {}
        for index, name in enumerate(names):
            tag = name[name.index("{") + 1 : name.index("}")] if self.sharded else ""
            groups.setdefault(tag, []).append(index)
        return [
            group[i : i + BATCH] for group in groups.values() for i in range(0, len(group), BATCH)
        ]


def _glob_escape(text: str) -> str:
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


# KEYS: routers, meta. ARGV: router ID, info JSON, known epoch ("" none), fresh epoch,
# settle window (ms). Heartbeats, notices a store that lost its data (its epoch is gone or
# changed under a router that knew it) and opens the settle window, and answers with the
# server time, the epoch, the settle deadline, this router's heartbeat as it was (empty when
# it was given up; another process's when two use one router ID), and every heartbeat.
ROUND = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local epoch = redis.call('HGET', KEYS[2], 'epoch')
local lost = 0
if not epoch then
  epoch = ARGV[4]
  redis.call('HSET', KEYS[2], 'epoch', epoch)
  if ARGV[3] ~= '' then lost = 1 end
elseif ARGV[3] ~= '' and epoch ~= ARGV[3] then
  lost = 1
end
if lost == 1 then
  local until_ms = now + tonumber(ARGV[5])
  local current = tonumber(redis.call('HGET', KEYS[2], 'settle_until') or '0') or 0
  if until_ms > current then redis.call('HSET', KEYS[2], 'settle_until', until_ms) end
end
local previous = redis.call('HGET', KEYS[1], ARGV[1])
redis.call('HSET', KEYS[1], ARGV[1], now .. ' ' .. ARGV[2])
local settle = redis.call('HGET', KEYS[2], 'settle_until') or '0'
return {'TAG', now, epoch, settle, previous or '', redis.call('HGETALL', KEYS[1])}
"""

# KEYS: pool, meta, routers, pools. ARGV: router ID, wanted, budget, known epoch.
# Grants only from what no router holds. A holder whose heartbeat is gone was given up:
# its credits return to the pool here. No grant while the store settles after a loss, nor
# to a router that has not seen the store's current epoch (the store lost its data since
# that router's last round: what the others hold is not written again yet), nor to one
# given up whose next round has not come yet; held -1 says so.
GRANT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local epoch = redis.call('HGET', KEYS[2], 'epoch')
if not epoch or epoch ~= ARGV[4] then return {'TAG', -1, 0, 0} end
if redis.call('HEXISTS', KEYS[3], ARGV[1]) == 0 then return {'TAG', -1, 0, 0} end
local settle = tonumber(redis.call('HGET', KEYS[2], 'settle_until') or '0') or 0
local held = redis.call('HGETALL', KEYS[1])
local mine, others = 0, 0
for i = 1, #held, 2 do
  local who, amount = held[i], tonumber(held[i + 1]) or 0
  if who == ARGV[1] then
    mine = amount
  elseif redis.call('HEXISTS', KEYS[3], who) == 0 then
    redis.call('HDEL', KEYS[1], who)
  else
    others = others + amount
  end
end
redis.call('SADD', KEYS[4], KEYS[1])
if now < settle then return {'TAG', mine, 0, others} end
local free = tonumber(ARGV[3]) - mine - others
local grant = math.min(tonumber(ARGV[2]), math.max(free, 0))
if grant > 0 then
  mine = mine + grant
  redis.call('HSET', KEYS[1], ARGV[1], mine)
end
return {'TAG', mine, grant, others}
"""

# KEYS: routers, pools. ARGV: router ID, oldest heartbeat (server ms) still counted as
# alive. Gives a router up (drops its heartbeat and every credit it held) unless its
# heartbeat came back meanwhile. Also how a router leaves on shutdown (oldest = huge).
GIVE_UP = """
local beat = redis.call('HGET', KEYS[1], ARGV[1])
if beat then
  local stamp = tonumber(string.match(beat, '^(%d+)')) or 0
  if stamp >= tonumber(ARGV[2]) then return {'TAG', 0} end
  redis.call('HDEL', KEYS[1], ARGV[1])
end
local pools = redis.call('SMEMBERS', KEYS[2])
for _, pool in ipairs(pools) do
  redis.call('HDEL', pool, ARGV[1])
  if redis.call('HLEN', pool) == 0 then redis.call('SREM', KEYS[2], pool) end
end
return {'TAG', 1}
"""

# KEYS: day hashes. ARGV: router ID, its in-flight field ("ID~incarnation"), expiry (s),
# then each key's settled and in-flight tokens. One command for a round's daily writes
# instead of two per key: the client's work per command, not the store's, is what a round
# with thousands of changed keys spent its time on.
WRITE_DAYS = """
for i = 1, #KEYS do
  redis.call('HSET', KEYS[i], ARGV[1], ARGV[2 + 2 * i], ARGV[2], ARGV[3 + 2 * i])
  redis.call('EXPIRE', KEYS[i], ARGV[3])
end
return {'TAG', #KEYS}
"""

# KEYS: day hashes. Every one's fields, in order: one reply for a round's reads.
READ_DAYS = """
local out = {'TAG'}
for i = 1, #KEYS do out[i + 1] = redis.call('HGETALL', KEYS[i]) end
return out
"""


ROUND, GRANT, GIVE_UP, WRITE_DAYS, READ_DAYS = (
    script.replace("'TAG'", f"'{SCRIPT_TAG.decode()}'")
    for script in (ROUND, GRANT, GIVE_UP, WRITE_DAYS, READ_DAYS)
)


def password_of(path: str) -> str | None:
    """The password in --sync-password-file (None when no file is named). Raises
    ConfigError naming the file, never its content; the router reads it once at build, so
    that a missing file stops it with a message rather than a traceback from a task."""
    if not path:
        return None
    return read_secret_file(path, f"--sync-password-file {path}")


def connect(config: RouterConfig) -> tuple[Any, str]:
    """A client of the site's store, and its kind: "primary" (--sync-addr), "sentinel"
    (the primary found through Sentinel) or "cluster" (a Valkey Cluster). With Sentinel and
    on a cluster each grant and round waits for a replica's acknowledgement."""
    password = password_of(config.sync_password_file)
    options: dict[str, Any] = {
        "password": password,
        "socket_timeout": COMMAND_TIMEOUT,
        "socket_connect_timeout": COMMAND_TIMEOUT,
        "decode_responses": False,
        "health_check_interval": 0,
    }
    if config.sync_tls:
        options["ssl"] = True
        if config.sync_tls_ca_file:
            options["ssl_ca_certs"] = config.sync_tls_ca_file
    if config.sync_sentinels:
        addresses = [host_port(address) for address in config.sync_sentinels]
        sentinel = Sentinel(  # type: ignore[no-untyped-call]
            [(address.host, address.port) for address in addresses],
            sentinel_kwargs={k: v for k, v in options.items() if k != "decode_responses"},
            **options,
        )
        return sentinel.master_for(config.sync_master), "sentinel"
    if config.sync_cluster:
        nodes = [host_port(address) for address in config.sync_cluster]
        cluster = ValkeyCluster(
            startup_nodes=[ClusterNode(node.host, node.port) for node in nodes],
            # A round is retried next interval rather than waited on: one retry at most.
            cluster_error_retry_attempts=1,
            connection_error_retry_attempts=1,
            **{k: v for k, v in options.items() if k != "health_check_interval"},
        )
        return cluster, "cluster"
    address = host_port(config.sync_addr)
    return valkey_asyncio.Valkey(host=address.host, port=address.port, **options), "primary"


def primary_of(client: Any) -> tuple[Any, Any] | None:
    """The primary (host, port) a client through Sentinel last found; None for another
    client, or before it found one."""
    address = getattr(getattr(client, "connection_pool", None), "master_address", None)
    return address if isinstance(address, tuple) else None


async def control_node(client: Any, keys: Keys) -> dict[str, Any]:
    """On a cluster, the options that send a keyless command (WAIT, TIME) to the primary
    holding the site's control slot; nothing otherwise (one primary)."""
    if not isinstance(client, ValkeyCluster):
        return {}
    await client.initialize()
    return {"target_nodes": client.get_node_from_key(keys.routers)}


# -- reading replies --------------------------------------------------------------------------


def as_int(value: object, what: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, bytes | str):
        try:
            return int(value)
        except ValueError:
            pass
    raise BadReply(f"{what}: expected an integer, got {value!r:.60}")


def as_bytes(value: object, what: str) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    raise BadReply(f"{what}: expected a string, got {value!r:.60}")


def as_list(value: object, what: str, size: int | None = None) -> list[Any]:
    if not isinstance(value, list | tuple) or (size is not None and len(value) != size):
        raise BadReply(f"{what}: expected a list of {size or 'any'} items, got {value!r:.60}")
    return list(value)


def tagged(value: object, what: str, size: int) -> list[Any]:
    """A script's reply: its version tag first. Another tag means another script version
    answered (or something that is not this router's script at all)."""
    items = as_list(value, what, size)
    if as_bytes(items[0], what) != SCRIPT_TAG:
        raise BadReply(f"{what}: script version {items[0]!r:.40}, expected {SCRIPT_TAG!r}")
    return items


def pairs(value: object, what: str) -> dict[bytes, bytes]:
    """A flat HGETALL-style list (or a dict, as the client may already make it)."""
    if isinstance(value, dict):
        return {as_bytes(k, what): as_bytes(v, what) for k, v in value.items()}
    items = as_list(value, what)
    if len(items) % 2:
        raise BadReply(f"{what}: odd number of items in a field list")
    return {as_bytes(items[i], what): as_bytes(items[i + 1], what) for i in range(0, len(items), 2)}


def _is_entry(value: object) -> bool:
    """[entry ID, fields]: an ID first, never a list."""
    return isinstance(value, list | tuple) and len(value) == 2 and isinstance(value[0], bytes | str)


def stream_entries(value: object) -> list[tuple[bytes, dict[bytes, bytes]]]:
    """XREAD's answer for one stream: [(entry ID, fields)], empty when nothing is new."""
    if not value:
        return []
    if isinstance(value, dict):
        streams: Sequence[Any] = list(value.values())
    else:
        streams = [as_list(item, "XREAD stream", 2)[1] for item in as_list(value, "XREAD")]
    entries: list[tuple[bytes, dict[bytes, bytes]]] = []
    for stream in streams:
        items = stream
        if isinstance(items, list) and len(items) == 1 and not _is_entry(items[0]):
            items = items[0]  # RESP3 map form: [[entries]]
        for entry in as_list(items, "XREAD entries"):
            ident, fields = as_list(entry, "XREAD entry", 2)
            entries.append((as_bytes(ident, "entry ID"), pairs(fields, "entry fields")))
    return entries
