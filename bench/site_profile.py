"""py-spy profiles of a router under load, summarised: where the samples of the sync path
fall (--profile in bench/site.py).

py-spy is looked for on PATH, in the virtual environment and in
~/.cache/hivenet-router/tools/py-spy/bin (install it there with
`python3.11 -m venv ~/.cache/hivenet-router/tools/py-spy && \
~/.cache/hivenet-router/tools/py-spy/bin/pip install py-spy`).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import BIN, CACHE

# Samples with any frame from these files, by name.
GROUPS = {
    "sync (hivenet_router/sync)": re.compile(r"hivenet_router/sync/"),
    "valkey client (valkey-py)": re.compile(r"site-packages/valkey/"),
    "admission": re.compile(r"router/admission\.py"),
    "limits in memory (state/local.py)": re.compile(r"state/local\.py"),
}
_FRAME = re.compile(r"^(?P<name>.*) \((?P<file>[^:]+):(?P<line>\d+)\)$")


def find_py_spy() -> str | None:
    for candidate in (
        shutil.which("py-spy"),
        str(BIN / "py-spy"),
        str(CACHE / "tools" / "py-spy" / "bin" / "py-spy"),
    ):
        if candidate and Path(candidate).exists():
            return candidate
    return None


def record(py_spy: str, pid: int, seconds: int, out: Path, load: Callable[[], object]) -> None:
    """Sample `pid` for `seconds` (raw collapsed stacks into `out`) while `load` runs."""
    command = [py_spy, "record", "--pid", str(pid), "--duration", str(seconds)]
    command += ["--rate", "250", "--format", "raw", "--output", str(out), "--nonblocking"]
    spy = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    worker = threading.Thread(target=load, daemon=True)
    worker.start()
    try:
        _, err = spy.communicate(timeout=seconds + 60)
    except subprocess.TimeoutExpired:
        spy.kill()
        _, err = spy.communicate(timeout=10)
    worker.join(timeout=seconds + 60)
    # py-spy 0.4 can panic while tearing down after it wrote the samples (a thread of the
    # target ended during the run): the file it wrote is still whole.
    if not out.exists() or (spy.returncode != 0 and b"Wrote raw" not in err):
        raise SystemExit(f"py-spy failed ({spy.returncode}): {err.decode(errors='replace')[-500:]}")


def _short(frame: str) -> str:
    match = _FRAME.match(frame.strip())
    if not match:
        return frame.strip()
    path = match.group("file")
    for marker in ("site-packages/", "hivenet_router/", "lib/python3.11/"):
        if marker in path:
            path = path.split(marker, 1)[1]
            break
    return f"{match.group('name')} ({path})"


def summarise(raw: Path, top: int = 12) -> dict[str, Any]:
    """Samples in all; the share of samples in each group; the top leaf functions."""
    total = 0
    groups: Counter[str] = Counter()
    leaves: Counter[str] = Counter()
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not count_text.isdigit():
            continue
        count = int(count_text)
        total += count
        frames = stack.split(";")
        for name, pattern in GROUPS.items():
            if pattern.search(stack):
                groups[name] += count
        leaves[_short(frames[-1])] += count
    return {
        "samples": total,
        "groups": {name: round(groups[name] / max(total, 1), 4) for name in GROUPS},
        "top": [(name, round(n / max(total, 1), 4)) for name, n in leaves.most_common(top)],
    }
