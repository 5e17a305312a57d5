"""Lines written off the event loop: one thread per sink, behind a bounded buffer.

The event loop only appends a finished line to a deque. A writer thread wakes when the
buffer goes from empty to not empty, waits a moment so lines gather into one write, and
writes them with plain `os.write` calls. A slow or full disk therefore never stalls a
request: when the buffer is full the line is dropped and counted, and a failed write
drops its batch, counts it and warns once per outage. `reopen()` (on SIGHUP) makes the
thread open the path afresh before its next write, which is what logrotate needs.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger("hivenet.router")

STDOUT = "-"
STDERR = "stderr"
_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)


class LineWriter:
    """Append lines to `path` (or standard output for "-", standard error for "stderr")."""

    def __init__(
        self, path: str, *, what: str, limit: int = 50_000, gather: float = 0.05, mode: int = 0o640
    ) -> None:
        self.path = path
        self.what = what  # how warnings name this sink ("audit")
        self.limit = limit
        self.gather = gather
        self.mode = mode
        self.written = 0  # counted by the writer thread
        self._full = 0  # dropped because the buffer was full (counted by the loop)
        self._failed = 0  # dropped because a write failed (counted by the writer thread)
        self.fallback = False  # the path could not be opened: lines go to standard output
        self._lines: deque[bytes] = deque()
        # The unwritten end of a line a failed write cut short: written first next time, so
        # the file never holds half a line with the next record glued to it.
        self._rest = b""
        self._closed = False
        self._wake = threading.Event()
        self._reopen = False
        self._stopping = False
        self._failing = False
        self._fd = self._open()
        self._thread = threading.Thread(target=self._run, name=f"{what}-writer", daemon=True)
        self._thread.start()

    # -- the event loop's side ------------------------------------------------------------------

    def put(self, line: bytes) -> bool:
        """Queue one line (with its newline). False when the buffer was full and it was dropped."""
        lines = self._lines
        if len(lines) >= self.limit or self._closed:
            self._full += 1
            return False
        lines.append(line)
        if len(lines) == 1:
            self._wake.set()
        return True

    def reopen(self) -> None:
        """Open the path again before the next write (the file may have been rotated)."""
        self._reopen = True
        self._wake.set()

    def close(self, timeout: float = 2.0) -> None:
        """Write what is buffered (within `timeout`), then stop the thread."""
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)
        self._closed = True  # a line put from now on is counted as dropped, not lost
        if self._rest and not self._thread.is_alive():
            self._rest = b""  # a line cut short whose end could not be written before the end
            self._failed += 1
        if self._fd > 2 and not self._thread.is_alive():  # a thread stuck in write keeps it
            os.close(self._fd)
            self._fd = -1

    @property
    def dropped(self) -> int:
        """Lines lost: the buffer was full, or their write failed."""
        return self._full + self._failed

    @property
    def buffered(self) -> int:
        return len(self._lines)

    # -- the writer thread -------------------------------------------------------------------

    def _open(self) -> int:
        if self.path == STDOUT:
            return 1
        if self.path == STDERR:
            return 2
        try:
            parent = os.path.dirname(self.path)
            if parent:
                os.makedirs(parent, exist_ok=True)
            fd = os.open(self.path, _FLAGS, self.mode)
        except OSError as exc:
            self.fallback = True
            # Through logging, so that --log-format json keeps every line JSON; and
            # hivenet_log_fallback says so for as long as it lasts (a collector tailing the
            # file misses these lines).
            log.error(
                "%s: cannot open %s: %s; writing to standard output instead",
                self.what,
                self.path,
                exc.strerror or exc,
            )
            return 1
        self.fallback = False
        return fd

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            if not self._stopping:
                time.sleep(self.gather)  # let a burst of lines gather into one write
            self._turn()
            if self._stopping:
                # Lines put, or a reopen asked (a rotation just before the end), while the
                # last batch was being written.
                self._turn()
                return

    def _turn(self) -> None:
        if self._reopen:
            self._reopen = False
            self._swap()
        self._drain()

    def _swap(self) -> None:
        if self._rest:
            # The end of a line cut short belongs to the old file: a rotated file must not
            # begin with half a record. The line is lost.
            self._rest = b""
            self._failed += 1
        old = self._fd
        self._fd = self._open()
        if old > 2:
            os.close(old)

    def _drain(self) -> None:
        lines = self._lines
        batch: list[bytes] = []
        while True:
            try:
                batch.append(lines.popleft())
            except IndexError:
                break
            if len(batch) >= 4096:
                self._write(batch)
                batch = []
        if batch or self._rest:
            self._write(batch)

    def _write(self, batch: list[bytes]) -> None:
        rest = self._rest
        data = memoryview(b"".join([rest, *batch]) if rest else b"".join(batch))
        size = len(data)
        try:
            while data:
                data = data[os.write(self._fd, data) :]
        except OSError as exc:
            self._settle(rest, batch, size - len(data))
            if not self._failing:
                self._failing = True
                log.warning(
                    "%s: writing to %s failed (%s); lines are dropped and counted until it works",
                    self.what,
                    self.path,
                    exc.strerror or exc,
                )
            return
        if self._failing:
            self._failing = False
            log.warning("%s: writing to %s works again", self.what, self.path)
        self._rest = b""
        self.written += len(batch) + (1 if rest else 0)

    def _settle(self, rest: bytes, batch: list[bytes], sent: int) -> None:
        """Count a write that failed after `sent` bytes: whole lines are written, a line cut
        short keeps its end for the next write, and the lines after it are dropped."""
        if rest:
            if sent < len(rest):
                self._rest = rest[sent:]
                self._failed += len(batch)
                return
            sent -= len(rest)
            self.written += 1
            self._rest = b""
        for at, line in enumerate(batch):
            if sent >= len(line):
                sent -= len(line)
                self.written += 1
                continue
            if sent:
                self._rest = line[sent:]  # counted when its end is written
            self._failed += len(batch) - at - (1 if sent else 0)
            return


class WriterCollector(Collector):
    """Each writer's lines written, dropped and waiting, read when Prometheus scrapes."""

    def __init__(self, writers: Mapping[str, LineWriter]) -> None:
        self._writers = writers

    def collect(self) -> Iterable[Metric]:
        labels = ["log"]
        written = CounterMetricFamily(
            "hivenet_log_lines_written", "Lines written by a log writer", labels=labels
        )
        dropped = CounterMetricFamily(
            "hivenet_log_lines_dropped",
            "Lines lost because the writer's buffer was full or its write failed",
            labels=labels,
        )
        waiting = GaugeMetricFamily(
            "hivenet_log_lines_buffered", "Lines waiting for the writer thread", labels=labels
        )
        fallback = GaugeMetricFamily(
            "hivenet_log_fallback",
            "1 while a log writer writes to standard output because its file could not be opened",
            labels=labels,
        )
        for name, writer in self._writers.items():
            written.add_metric([name], writer.written)
            dropped.add_metric([name], writer.dropped)
            waiting.add_metric([name], writer.buffered)
            fallback.add_metric([name], 1.0 if writer.fallback else 0.0)
        yield from (written, dropped, waiting, fallback)
