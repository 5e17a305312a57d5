"""The meter's own cost per stream, against the code before it (docs/benchmarks.md, "The
meter on streams without usage").

    python bench/meter_micro.py src                 # this tree
    python bench/meter_micro.py /tmp/old/src        # an older tree (git archive REV src)

Feeds one 64-token OpenAI stream through what meters it: before, the usage reader and two
data-line counters (wallet, daily budget); now, the usage reader, the text count and the
filter that keeps the usage event from a client that did not ask.
"""

from __future__ import annotations

import sys
import timeit
from collections.abc import Callable

sys.path.insert(0, sys.argv[1] if len(sys.argv) > 1 else "src")
import hivenet_router.domain.usage as u

HEAD = b'data: {"id":"chatcmpl-0123456789abcdef01234567","object":"chat.completion.chunk",'
HEAD += b'"created":1700000000,"model":"sim-model",'
EVENT = HEAD + b'"choices":[{"index":0,"delta":{"content":" tokens"},"logprobs":null,'
EVENT += b'"finish_reason":null}]}\n\n'
USAGE = HEAD + b'"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":64,'
USAGE += b'"total_tokens":71}}\n\n'
DONE = b"data: [DONE]\n\n"


def before() -> None:
    meter, wallet, daily = u.StreamMeter(), u.DataLines(), u.DataLines()  # type: ignore[attr-defined]
    for chunk in [EVENT] * 64 + [DONE]:
        meter.feed(chunk)
        wallet.feed(chunk)
        daily.feed(chunk)
    meter.result()


def now() -> None:
    meter, text, drop = u.StreamMeter(), u.TextMeter(), u.UsageEvents()
    for chunk in [EVENT] * 64 + [USAGE, DONE]:
        meter.feed(chunk)
        text.feed(chunk)
        drop(chunk)
    meter.reported()
    text.tokens()
    drop.flush()


def main() -> None:
    run: Callable[[], None] = now if hasattr(u, "TextMeter") else before
    rounds = 3000
    best = min(timeit.repeat(run, number=rounds, repeat=5)) / rounds * 1e6
    print(f"{run.__name__}: {best:.1f} us per 64-token stream")


if __name__ == "__main__":
    main()
