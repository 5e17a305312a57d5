"""How far the text count of output tokens (domain/usage.py, used when a stream reports no
usage) is from the engine's own usage, on the simulator or on llama.cpp.

    PYTHONPATH=src python -m bench.text_count sim
    PYTHONPATH=src python -m bench.text_count llama   # after scripts/real_engines.sh

Each request streams with `include_usage`; the text relayed is counted as the router counts
it, at the fixed starting ratio and at the ratio learned from the requests before it. The
table in docs/admission.md ("One meter") comes from this script.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx2 as httpx
import orjson

from hivenet_router.domain.usage import OutputRatio, TextMeter

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [
    "Say hello.",
    "Write a story about a dragon.",
    "List ten fruits.",
    "Explain how a router works.",
    "Write Python code to sort a list.",
    "Écris une phrase en français.",
    "Count from one to twenty.",
    "What is 2+2?",
]
WARM = 8  # requests that teach the ratio before the learned error is measured


def engine(which: str) -> tuple[subprocess.Popen[bytes], str, str]:
    if which == "sim":
        port, model = 18932, "sim"
        code = "import sys; from hivenet_router.cli import sim_main; sys.exit(sim_main())"
        args = [sys.executable, "-c", code, "--port", str(port)]
        args += ["--zero-latency", "--model", model]
    else:
        printed = subprocess.run(
            ["bash", str(ROOT / "scripts" / "real_engines.sh"), "--print"],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        paths = dict(line.split("=", 1) for line in printed.splitlines() if "=" in line)
        port, model = 18931, "gemma"
        args = [paths["LLAMA_SERVER"], "-m", paths["LLAMA_CHAT_MODEL"], "-a", model, "-c", "2048"]
        args += ["-np", "1", "-t", "1", "--no-jinja", "--chat-template", "gemma"]
        args += ["--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(240):
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    return proc, url, model


def one(url: str, route: str, body: dict[str, Any]) -> tuple[int, int]:
    """The engine's completion tokens and the text bytes the router would count."""
    text, raw = TextMeter(), b""
    with httpx.stream("POST", url + route, json=body, timeout=120) as answer:
        for chunk in answer.iter_bytes():
            text.feed(chunk)
            raw += chunk
    text.tokens()  # counts an unfinished last line
    exact = 0
    for line in raw.split(b"\n"):
        if line.startswith(b"data: {") and b'"usage"' in line:
            usage = orjson.loads(line[6:]).get("usage")
            if usage:
                exact = int(usage["completion_tokens"])
    return exact, text.text_bytes


def main(which: str) -> None:
    proc, url, model = engine(which)
    ratios = OutputRatio()
    rows: list[tuple[int, int, int]] = []  # exact, fixed-ratio count, learned-ratio count
    total_bytes = 0
    try:
        for route in ("/v1/chat/completions", "/v1/completions"):
            for prompt in PROMPTS:
                for limit in (16, 64, 200):
                    body: dict[str, Any] = {
                        "model": model, "max_tokens": limit, "stream": True,
                        "stream_options": {"include_usage": True}, "temperature": 0.8,
                    }  # fmt: skip
                    if route == "/v1/completions":
                        body["prompt"] = prompt
                    else:
                        body["messages"] = [{"role": "user", "content": prompt}]
                    exact, size = one(url, route, body)
                    fixed = -(-size // 4)
                    learned = -(-size // ratios.get(model))
                    ratios.learn(model, size, exact)
                    rows.append((exact, fixed, int(learned)))
                    total_bytes += size
    finally:
        proc.terminate()
        proc.wait()
    exact = sum(r[0] for r in rows)
    fixed = sum(r[1] for r in rows)
    later = rows[WARM:]
    errors = sorted((r[2] - r[0]) / r[0] for r in later if r[0])
    learned_exact, learned = sum(r[0] for r in later), sum(r[2] for r in later)
    print(f"{which}: {len(rows)} requests, {exact} tokens, {total_bytes / exact:.2f} bytes/token")
    print(f"fixed 4 bytes/token: total error {100 * (fixed - exact) / exact:+.1f} %")
    print(
        f"learned: total error {100 * (learned - learned_exact) / learned_exact:+.1f} %, per "
        f"request min {100 * errors[0]:+.0f} % median {100 * errors[len(errors) // 2]:+.0f} % "
        f"max {100 * errors[-1]:+.0f} %"
    )


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "sim")
