"""The off-loop line writer: order, rotation, fallback, full disks and stuck readers."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import orjson
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from hivenet_router.observability.linewriter import LineWriter, WriterCollector
from tests.procs import metric, wait_until


def test_lines_reach_the_file_in_order(tmp_path: Path) -> None:
    path = tmp_path / "logs" / "audit.jsonl"  # the folder is made
    writer = LineWriter(str(path), what="audit", gather=0.001)
    for n in range(1000):
        assert writer.put(b"%d\n" % n)
    writer.close()
    assert path.read_bytes().split() == [b"%d" % n for n in range(1000)]
    assert writer.written == 1000
    assert writer.dropped == 0
    assert not writer.fallback


def test_reopen_follows_a_rotated_file(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    writer = LineWriter(str(path), what="audit", gather=0.001)
    writer.put(b"before\n")
    wait_until(lambda: writer.written == 1, timeout=5)
    path.rename(tmp_path / "audit.jsonl.1")
    writer.reopen()
    wait_until(path.exists, timeout=5)
    writer.put(b"after\n")
    writer.close()
    assert (tmp_path / "audit.jsonl.1").read_bytes() == b"before\n"
    assert path.read_bytes() == b"after\n"


def test_a_path_that_cannot_be_opened_falls_back_to_stdout_and_says_so(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    writer = LineWriter(str(blocker / "audit.jsonl"), what="audit", gather=0.001)
    with caplog.at_level(logging.ERROR, logger="hivenet.router"):
        writer.put(b'{"line":1}\n')
        writer.close()
    out, _err = capfd.readouterr()
    assert writer.fallback
    assert out == '{"line":1}\n'
    # Through logging (a JSON line under --log-format json), once; and as a metric for as
    # long as it lasts (found by an SRE: a collector tailing the file lost these lines).
    said = [r.getMessage() for r in caplog.records if "cannot open" in r.getMessage()]
    assert len(said) == 1 and "writing to standard output instead" in said[0]
    metrics = WriterCollector({"audit": writer})
    (family,) = [f for f in metrics.collect() if f.name == "hivenet_log_fallback"]
    assert [s.value for s in family.samples] == [1.0]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_disk_drops_and_counts_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    writer = LineWriter("/dev/full", what="audit", gather=0.001)
    with caplog.at_level(logging.WARNING, logger="hivenet.router"):
        for _ in range(3):
            writer.put(b"x\n")
            wait_until(lambda: writer.buffered == 0, timeout=5)
            time.sleep(0.01)
        wait_until(lambda: writer.dropped == 3, timeout=5)
    writer.close()
    assert writer.written == 0
    failures = [r for r in caplog.records if "failed" in r.getMessage()]
    assert len(failures) == 1


def test_a_reader_that_never_reads_never_blocks_the_caller(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # opened, never read
    try:
        writer = LineWriter(str(fifo), what="audit", limit=100, gather=0.001)
        line = b"y" * 1000 + b"\n"
        started = time.monotonic()
        results = [writer.put(line) for _ in range(2000)]  # far past the pipe's buffer
        assert time.monotonic() - started < 1.0
        wait_until(lambda: writer.buffered == writer.limit, timeout=5)
        assert not writer.put(line)
        assert results.count(False) > 0
        assert writer.dropped >= results.count(False) + 1
        registry = CollectorRegistry()
        registry.register(WriterCollector({"audit": writer}))
        page = generate_latest(registry).decode()
        assert metric(page, "hivenet_log_lines_dropped_total", log="audit") == writer.dropped
        assert metric(page, "hivenet_log_lines_buffered", log="audit") == writer.limit
        writer.close(timeout=0.2)  # the thread is stuck in write(): close gives up on it
    finally:
        os.close(reader)


_CUT_SHORT = """
import os, resource, signal, sys, time
from hivenet_router.observability.linewriter import LineWriter

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
writer = LineWriter(sys.argv[1], what="audit", gather=0.05)  # the lines go as one batch
line = lambda n: b'{"n":%d,"pad":"%s"}\\n' % (n, b"x" * 40)
resource.setrlimit(resource.RLIMIT_FSIZE, (150, hard))  # the disk fills mid-batch
for n in range(4):
    writer.put(line(n))
while writer.dropped < 1:
    time.sleep(0.01)
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))  # space is freed
if sys.argv[2:] == ["rotate"]:
    os.rename(sys.argv[1], sys.argv[1] + ".1")
    writer.reopen()
writer.put(line(99))
writer.close()
print(writer.written, writer.dropped)
"""


def test_a_write_cut_short_by_a_full_disk_finishes_its_line_later(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    done = subprocess.run(
        [sys.executable, "-c", _CUT_SHORT, str(path)],
        capture_output=True,
        timeout=30,
        check=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    written, dropped = map(int, done.stdout.split())
    lines = path.read_bytes().splitlines()
    # 150 bytes hold two lines of 56 bytes and part of the third; the third's end is
    # written once the disk has room, the fourth was dropped, and the next record starts
    # a line of its own.
    assert [orjson.loads(line)["n"] for line in lines] == [0, 1, 2, 99]
    assert (written, dropped) == (4, 1)


def test_a_line_cut_short_before_a_rotation_stays_out_of_the_new_file(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    done = subprocess.run(
        [sys.executable, "-c", _CUT_SHORT, str(path), "rotate"],
        capture_output=True,
        timeout=30,
        check=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    written, dropped = map(int, done.stdout.split())
    assert [orjson.loads(line)["n"] for line in path.read_bytes().splitlines()] == [99]
    assert (written, dropped) == (3, 2)  # the cut line is lost, and counted


_BIG = b"a" * 200_000 + b"\n"  # more than a pipe holds


def _stuck_in_a_write(fifo: Path) -> tuple[LineWriter, threading.Thread, list[bytes]]:
    """A writer whose thread is stuck writing `_BIG` to a FIFO that its reader drains only
    after 0.3 s; what the reader got lands in the list."""
    os.mkfifo(fifo)
    got: list[bytes] = []

    def read_slowly() -> None:
        with open(fifo, "rb") as pipe:
            time.sleep(0.3)  # the writer thread is stuck in write() meanwhile
            got.append(pipe.read())

    reader = threading.Thread(target=read_slowly)
    reader.start()
    writer = LineWriter(str(fifo), what="audit", gather=0.001)
    writer.put(_BIG)
    wait_until(lambda: writer.buffered == 0, timeout=5)  # taken by the thread
    return writer, reader, got


def test_a_line_put_while_the_last_batch_is_written_is_not_lost(tmp_path: Path) -> None:
    writer, reader, got = _stuck_in_a_write(tmp_path / "fifo")
    writer.put(b"last\n")
    writer.close()
    reader.join(5)
    assert got == [_BIG + b"last\n"]
    assert (writer.written, writer.dropped) == (2, 0)
    assert not writer.put(b"after close\n")
    assert writer.dropped == 1


def test_a_reopen_asked_while_the_last_batch_is_written_happens_before_the_end(
    tmp_path: Path,
) -> None:
    # Rotation, then shutdown, while the thread is stuck in a write: the line put after
    # the rotation belongs in the new file, not in the one that was moved away.
    writer, reader, got = _stuck_in_a_write(tmp_path / "audit.jsonl")
    os.rename(tmp_path / "audit.jsonl", tmp_path / "audit.jsonl.1")
    writer.reopen()
    writer.put(b"last\n")
    writer.close()
    reader.join(5)
    assert got == [_BIG]
    assert (tmp_path / "audit.jsonl").read_bytes() == b"last\n"
    assert (writer.written, writer.dropped) == (2, 0)
