"""The response cache in the site store (--sync-store=valkey): stored answers every router
of the site can replay, and flights that followers on other routers read.

Keys, under the site's prefix (one hash slot):
- `cache:<key>`: a stored answer, msgpack `[version, status, content type, streamed,
  created ms, bytes]`, expiring with the policy's TTL. A value that does not decode, or
  of another version, is a miss and is deleted.
- `flight:<key>`: the lock of the site's flight for that key, holding its leader's nonce;
  the leader renews it every second from its claim to its end (PX 3 s), head wait included,
  so a leader that dies lets it lapse within seconds. A renewal that finds the lock lapsed
  takes it again; one that finds another router's nonce has lost it: the leader stops
  publishing (a gone entry) and serves its own router's clients only.
- `flight:<key>:<nonce>`: the flight's stream: a head entry, chunk entries, then one end,
  error or gone entry; every entry numbered, so a gap (MAXLEN trimmed it) is seen. Kept a
  little after the end for followers still reading.
- `flight:<key>:<nonce>:w`: how many routers follow the flight: a leader whose own clients
  all left keeps going while another router still reads. Followers refresh its expiry
  (KEEP_MS) as they read, so it outlives any stream that is still read.

A follower router reads the stream with one task per key (XREAD BLOCK from the start) into
a local flight that its own identical requests share. Store errors never fail a request:
they are counted and the request goes on without the shared part.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from typing import Any, Final

import msgspec

from hivenet_router.clock import Clock
from hivenet_router.domain.answer import Answer, AnswerBroken, Outcome
from hivenet_router.domain.errors import ApiError, ErrorCode, code_from_str
from hivenet_router.gateway.cache_store import Stored, decode, encode
from hivenet_router.gateway.flight import Flight, OwnError, Reader

log = logging.getLogger("hivenet.cache")

LOCK_MS: Final = 3_000
RENEW_EVERY: Final = 1.0  # seconds
RELEASE_WAIT: Final = 1.0  # seconds a lock release may take at the end (or at shutdown)
BLOCK_MS: Final = 200  # under the site client's 0.5 s socket timeout
IDLE_CHECK: Final = 1.0  # seconds without an entry before a follower checks its leader
KEEP_MS: Final = 30_000  # a finished flight's stream, and a follower count not refreshed
MAX_STREAM: Final = 100_000  # entries per flight stream (MAXLEN ~)
READ_COUNT: Final = 512

# KEYS: lock, stream. ARGV: nonce, lock ms, stream ms. Renew the lock while it is ours, take
# it again if it lapsed (a pause, a store restart); 0 when another router holds it. The
# stream lives on with it, however long the engine is silent.
RENEW = (
    "local held = redis.call('GET', KEYS[1]) "
    "if held == ARGV[1] then redis.call('PEXPIRE', KEYS[1], ARGV[2]) "
    "elseif not held then redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2]) "
    "else return 0 end "
    "redis.call('PEXPIRE', KEYS[2], ARGV[3]) return 1"
)
# KEYS: key. ARGV: value. Delete it only while it holds that value (a lock that is still
# ours, a malformed entry no router has replaced since).
DELETE_IF = (
    "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"
)


class _Head(msgspec.Struct, array_like=True):
    status: int
    content_type: str
    whole: bool
    body: bytes


class _Error(msgspec.Struct, array_like=True):
    code: str
    message: str
    source: str
    status: int
    retry_after: str = ""  # added later: older routers ignore it, newer read it as ""


class LeaderLost(Exception):
    """The other router's flight ended before its head (its leader died, or was refused for
    its own reasons): the follower goes on as a request of its own."""


class SharedCache:
    def __init__(self, client: Any, prefix: str, clock: Clock) -> None:
        self.client = client
        self.prefix = prefix
        self.clock = clock
        self.errors: dict[str, int] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False

    def failed(self, kind: str, exc: BaseException) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1
        log.warning("response cache: site store %s failed: %s", kind, exc)

    def entry_key(self, key: str) -> str:
        return f"{self.prefix}cache:{key}"

    def lock_key(self, key: str) -> str:
        return f"{self.prefix}flight:{key}"

    # -- stored answers -----------------------------------------------------------------------

    async def get(self, key: str) -> Stored | None:
        try:
            raw = await self.client.get(self.entry_key(key))
        except Exception as exc:
            self.failed("get", exc)
            return None
        if raw is None:
            return None
        stored = decode(raw) if isinstance(raw, bytes) else None
        if stored is None:
            self.failed("malformed", ValueError("a stored answer did not decode; deleted"))
            self.spawn(self.drop(key, raw))
        return stored

    async def drop(self, key: str, raw: Any) -> None:
        """Delete the stored answer under `key` if it is still `raw` (another router may
        have written a good one since)."""
        try:
            await self.client.eval(DELETE_IF, 1, self.entry_key(key), raw)
        except Exception as exc:
            self.failed("delete", exc)

    def put(self, key: str, stored: Stored, ttl: float) -> None:
        self.spawn(self.put_now(key, stored, ttl))

    async def put_now(self, key: str, stored: Stored, ttl: float) -> None:
        try:
            await self.client.set(self.entry_key(key), encode(stored), px=max(int(ttl * 1000), 1))
        except Exception as exc:
            self.failed("set", exc)

    def spawn(self, work: Any) -> None:
        if self._closed:
            work.close()  # after close: a store write is best-effort, the loop is ending
            return
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self, timeout: float) -> None:
        """Let the publishers publish their flights' ends and release their locks, and the
        store writes finish, for up to `timeout` seconds; then cancel what is left (a
        publisher still releases its lock, within RELEASE_WAIT)."""
        loop = asyncio.get_running_loop()
        until = loop.time() + timeout
        while self._tasks and (left := until - loop.time()) > 0:
            await asyncio.wait(set(self._tasks), timeout=left)  # they may spawn more
        self._closed = True
        tasks = set(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=RELEASE_WAIT + 0.5)

    # -- flights ------------------------------------------------------------------------------

    async def claim(self, key: str) -> tuple[str, bool] | None:
        """Take the site's flight lock for `key`: (our nonce, True) when taken, (the
        leader's nonce, False) when another router leads, None when the store failed."""
        nonce = secrets.token_hex(8)
        try:
            held = await self.client.set(self.lock_key(key), nonce, nx=True, get=True, px=LOCK_MS)
        except Exception as exc:
            self.failed("lock", exc)
            return None
        if held is None:
            return nonce, True
        return (held.decode() if isinstance(held, bytes) else str(held)), False

    def publish(self, key: str, nonce: str, flight: Flight, deadline: float) -> None:
        """Publish `flight` for the site's followers, as a reader that keeps it going while
        another router follows it."""
        reader = flight.join(keeper=True)
        self.spawn(Publisher(self, key, nonce, flight, reader, deadline).run())

    async def follow(
        self, key: str, nonce: str, deadline: float, headers: dict[str, str] | None = None
    ) -> Answer:
        """The answer of another router's flight, read from its stream. Raises LeaderLost
        when that flight ends before its head, ApiError with the leader's refusal (whose
        Retry-After goes into `headers`)."""
        follower = Follower(self, key, nonce)
        try:
            async with asyncio.timeout_at(deadline):
                return await follower.open(headers if headers is not None else {})
        except AnswerBroken:
            # Its end came before anything was served from it: not an answer, not a refusal.
            follower.close(Outcome.BROKEN)
            raise LeaderLost() from None
        except TimeoutError:
            follower.close(Outcome.TIMEOUT)
            raise ApiError(
                ErrorCode.REQUEST_TIMEOUT,
                "Request deadline exceeded waiting for an identical request's answer",
            ) from None
        except BaseException:
            follower.close(Outcome.BROKEN)
            raise


def _stream_key(shared: SharedCache, key: str, nonce: str) -> str:
    return f"{shared.lock_key(key)}:{nonce}"


class Publisher:
    """The leader's side: the flight's head, chunks and end into the site's stream."""

    def __init__(
        self,
        shared: SharedCache,
        key: str,
        nonce: str,
        flight: Flight,
        reader: Reader,
        deadline: float,
    ) -> None:
        self.shared, self.key, self.nonce = shared, key, nonce
        self.flight, self.reader, self.deadline = flight, reader, deadline
        self.stream = _stream_key(shared, key, nonce)
        self.lock = shared.lock_key(key)
        self.seq = 0
        self.pending: list[dict[bytes, bytes]] = []
        self.lost = False  # another router took the lock: no more publishing
        self.stored_written = False

    def _add(self, kind: bytes, data: bytes = b"") -> None:
        self.pending.append({b"k": kind, b"n": str(self.seq).encode(), b"d": data})
        self.seq += 1

    async def run(self) -> None:
        """Publish the flight from the claim to its end, the lock renewed all along."""
        renewing = asyncio.get_running_loop().create_task(self._renew())
        try:
            await self._run()
        except Exception as exc:
            self.shared.failed("publish", exc)
        finally:
            renewing.cancel()
            self.reader.close(Outcome.OK)
            stored = self.flight.stored
            if isinstance(stored, tuple) and not self.stored_written:
                self.shared.put(self.key, *stored)  # ended after the last publish
            await asyncio.wait([renewing])
            await self._release()

    async def _renew(self) -> None:
        """Keep the lock (and the stream) alive; a failed renewal is counted and tried
        again, a lock another router holds is lost."""
        while True:
            await asyncio.sleep(RENEW_EVERY)
            keys = (self.lock, self.stream)
            try:
                ours = await self.shared.client.eval(
                    RENEW, 2, *keys, self.nonce, LOCK_MS, KEEP_MS + LOCK_MS
                )
            except Exception as exc:
                self.shared.failed("lock", exc)
                continue
            if not ours:
                log.warning("response cache: another router took the lock of a flight")
                self.lost = True
                self.flight.wake()
                return

    async def _run(self) -> None:
        if not await self._head():
            self._add(b"g")  # followers that have no head yet go on by themselves
            await self._flush(final=True)
            return
        try:
            answer = await self.reader.answer(self.deadline)
        except ApiError as exc:
            if self.flight.stopped:
                self._add(b"g")  # stopped here, not refused: followers go on by themselves
            else:
                retry = self.flight.refusal_headers.get("Retry-After", "")
                error = _Error(exc.code.value, exc.message, exc.source, exc.http_status, retry)
                self._add(b"x", msgspec.msgpack.encode(error))
            await self._flush(final=True)
            return
        except OwnError:
            self._add(b"g")  # the leader's own refusal: followers go on by themselves
            await self._flush(final=True)
            return
        whole = answer.body is not None
        head = _Head(answer.status, answer.header("content-type") or "", whole, answer.body or b"")
        self._add(b"h", msgspec.msgpack.encode(head))
        if answer.first is not None:
            self._add(b"c", answer.first)
        while not await self._step():
            pass

    async def _head(self) -> bool:
        """Wait for the flight's head; False to give up first: the lock is lost, or the
        leader's clients left and no router follows (the engine call stops)."""
        loop = asyncio.get_running_loop()
        while not self.flight.head_ready and loop.time() < self.deadline:
            if self.lost or (self._alone() and not await self._watched()):
                return False
            await self.reader.wait_head(min(RENEW_EVERY, max(self.deadline - loop.time(), 0)))
        return True

    def _alone(self) -> bool:
        return self.flight.readers == self.flight.keepers

    async def _step(self) -> bool:
        """Publish what is buffered; True once the flight's end is published."""
        flight = self.flight
        if self.lost and not flight.ended:
            self._add(b"g")  # the site's followers now follow the router that took the lock
            await self._flush(final=True)
            return True
        for chunk in self.reader.available():
            self._add(b"c", chunk)
        if flight.ended:  # and every chunk is drained above: nothing is added after the end
            if flight.complete:
                self._add(b"e")
            elif flight.failure is not None:
                error = _Error(flight.failure.code.value, flight.failure.message, "router", 0)
                self._add(b"x", msgspec.msgpack.encode(error))
            else:
                self._add(b"g")
            await self._flush(final=True)
            return True
        await self._flush(final=False)
        # The flight may end while we await the store: then its end is published, not "g".
        if self._alone() and not flight.ended and not await self._watched() and not flight.ended:
            self._add(b"g")  # nobody reads it any more, here or elsewhere: stop the engine
            await self._flush(final=True)
            return True
        await self.reader.wait(RENEW_EVERY)
        return False

    async def _watched(self) -> bool:
        try:
            count = await self.shared.client.get(self.stream + ":w")
        except Exception as exc:
            self.shared.failed("publish", exc)
            return False
        return bool(count) and int(count) > 0

    async def _flush(self, final: bool) -> None:
        if not self.pending:
            return
        entries, self.pending = self.pending, []
        async with self.shared.client.pipeline(transaction=False) as pipe:
            for fields in entries:
                pipe.xadd(self.stream, fields, maxlen=MAX_STREAM, approximate=True)
            if final:
                stored = self.flight.stored
                if isinstance(stored, tuple):
                    entry, ttl = stored
                    pipe.set(self.shared.entry_key(self.key), encode(entry), px=int(ttl * 1000))
                    self.stored_written = True
                pipe.pexpire(self.stream, KEEP_MS)
            else:
                pipe.pexpire(self.stream, KEEP_MS + int(LOCK_MS))
            await pipe.execute()

    async def _release(self) -> None:
        try:
            async with asyncio.timeout(RELEASE_WAIT):
                await self.shared.client.eval(DELETE_IF, 1, self.lock, self.nonce)
        except Exception as exc:
            self.shared.failed("lock", exc)


Entries = list[tuple[bytes, dict[bytes, bytes]]]


class Follower:
    """A follower router's side: another router's flight, read from its stream as an
    answer (the source of a local flight)."""

    def __init__(self, shared: SharedCache, key: str, nonce: str) -> None:
        self.shared, self.key, self.nonce = shared, key, nonce
        self.stream = _stream_key(shared, key, nonce)
        self.last = b"0-0"
        self.seq = 0
        self.buffered: list[tuple[bytes, bytes]] = []  # (kind, data) read, not yet taken
        self.watching = False
        self.refreshed = 0.0  # when the follower count's expiry was last pushed back
        self.closed = False

    async def open(self, refusal_headers: dict[str, str]) -> Answer:
        """The head, and a stream's first chunk. Raises AnswerBroken when the flight ends
        first, LeaderLost when it gives up, ApiError with its refusal."""
        await self._watch(1)
        kind, data = await self._take()
        if kind == b"x":
            error = _decode_error(data)
            if error is not None and error.retry_after:
                refusal_headers["Retry-After"] = error.retry_after
            raise _refusal(error)
        if kind != b"h":
            raise LeaderLost()
        try:
            head = msgspec.msgpack.decode(data, type=_Head)
        except (msgspec.DecodeError, msgspec.ValidationError):
            raise LeaderLost() from None
        headers = [("content-type", head.content_type)] if head.content_type else []
        if head.whole:
            return Answer(head.status, headers, self, body=head.body, origin="cache")
        first = await self.read()
        return Answer(head.status, headers, self, first=first, origin="cache")

    async def read(self) -> bytes | None:
        kind, data = await self._take()
        if kind == b"c":
            return data
        if kind == b"e":
            return None
        if kind == b"x":
            error = _decode_error(data)
            code = code_from_str(error.code) if error is not None else None
            raise AnswerBroken(code or ErrorCode.BACKEND_ERROR, error.message if error else "")
        raise AnswerBroken(
            ErrorCode.BACKEND_UNAVAILABLE, "the router serving this answer stopped it"
        )

    def close(self, outcome: Outcome) -> None:
        if not self.closed:
            self.closed = True
            if self.watching:
                self.shared.spawn(self._watch(-1))

    async def _watch(self, delta: int) -> None:
        watchers = self.stream + ":w"
        try:
            async with self.shared.client.pipeline(transaction=False) as pipe:
                pipe.incrby(watchers, delta)
                pipe.pexpire(watchers, KEEP_MS)
                await pipe.execute()
            self.watching = delta > 0
            self.refreshed = self.shared.clock.monotonic()
        except Exception as exc:
            self.shared.failed("follow", exc)

    async def _refresh(self) -> None:
        """Push back the follower count's expiry: the leader goes on while we read."""
        self.refreshed = self.shared.clock.monotonic()
        try:
            await self.shared.client.pexpire(self.stream + ":w", KEEP_MS)
        except Exception as exc:
            self.shared.failed("follow", exc)

    async def _take(self) -> tuple[bytes, bytes]:
        """The next entry; (b"g", b"") when the leader is gone or entries went missing."""
        idle_since = self.shared.clock.monotonic()
        while not self.buffered:
            if self.watching and self.shared.clock.monotonic() - self.refreshed >= KEEP_MS / 3e3:
                await self._refresh()
            try:
                got = await self.shared.client.xread(
                    {self.stream: self.last}, count=READ_COUNT, block=BLOCK_MS
                )
            except Exception as exc:
                self.shared.failed("follow", exc)
                return b"g", b""
            if self._keep(got):
                break
            if self.shared.clock.monotonic() - idle_since >= IDLE_CHECK:
                if not await self._leader_alive():
                    return b"g", b""
                idle_since = self.shared.clock.monotonic()
        return self.buffered.pop(0)

    def _keep(self, got: Any) -> bool:
        for _name, entries in _streams(got):
            for entry_id, fields in entries:
                self.last = entry_id
                if fields.get(b"n") != str(self.seq).encode():
                    self.buffered.append((b"g", b""))  # a gap: trimmed, or not ours
                    return True
                self.seq += 1
                self.buffered.append((fields.get(b"k", b"g"), fields.get(b"d", b"")))
        return bool(self.buffered)

    async def _leader_alive(self) -> bool:
        try:
            holder = await self.shared.client.get(self.shared.lock_key(self.key))
        except Exception as exc:
            self.shared.failed("follow", exc)
            return False
        return bool(holder == self.nonce.encode())


def _streams(got: Any) -> list[tuple[Any, Entries]]:
    """XREAD's reply as (stream, entries) pairs, in RESP2's list form or RESP3's dict."""
    if not got:
        return []
    if isinstance(got, dict):
        return [(name, value[0] if value else []) for name, value in got.items()]
    return [(item[0], item[1]) for item in got]


def _decode_error(data: bytes) -> _Error | None:
    try:
        return msgspec.msgpack.decode(data, type=_Error)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def _refusal(error: _Error | None) -> ApiError:
    code = code_from_str(error.code) if error is not None else None
    if error is None or code is None:
        return ApiError(ErrorCode.BACKEND_ERROR, "an identical request failed", "backend")
    return ApiError(code, error.message, error.source, error.status or None)
