"""The meter's own cost per stream, against the code before it (docs/benchmarks.md, "The
meter on streams without usage").

    python bench/meter_micro.py src                 # this tree
    python bench/meter_micro.py /tmp/old/src        # an older tree (git archive REV src)

Feeds one 64-token OpenAI stream through what meters it: before, the usage reader and two
data-line counters (wallet, daily budget); now, for an engine asked for usage, the usage
reader, the event count and the filter that keeps the usage event from a client that did
not ask (chunk by chunk, and in one chunk); for an engine that reports none, the text
count.
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


def _settle(meter: u.StreamMeter, drop: u.UsageEvents) -> None:
    """The end of a filtered stream: what is held, then the usage (handed over by the
    filter where it read it, since 2026-12-07's third session; else the meter's search)."""
    drop.flush()
    if getattr(drop, "found", None) is None:
        meter.reported()


def now() -> None:
    """An engine asked for usage: events counted, the usage event filtered, no text scan."""
    meter, drop = u.StreamMeter(), u.UsageEvents()
    meter.count_events(anthropic=False, framing=1)
    for chunk in [EVENT] * 64 + [USAGE, DONE]:
        meter.feed(chunk)
        drop(chunk)
    _settle(meter, drop)


def one_chunk() -> None:
    """The same stream read in one chunk (an engine that answers at once)."""
    meter, drop = u.StreamMeter(), u.UsageEvents()
    meter.count_events(anthropic=False, framing=1)
    chunk = EVENT * 64 + USAGE + DONE
    meter.feed(chunk)
    drop(chunk)
    _settle(meter, drop)


def three_chunks() -> None:
    """The same stream in three chunks, as the relay sees it under load (bench.overhead's
    sse loads average 3.4 chunks a stream through the agent)."""
    meter, drop = u.StreamMeter(), u.UsageEvents()
    events = [EVENT] * 64 + [USAGE, DONE]
    chunks = [b"".join(events[:2]), b"".join(events[2:34]), b"".join(events[34:])]
    meter.feed(chunks[0])
    u.stream_input_tokens(chunks[0])  # admission looks for an announced input count
    meter.count_events(anthropic=False, framing=1)
    for chunk in chunks:
        drop(chunk)
    for chunk in chunks[1:]:
        meter.feed(chunk)
    _settle(meter, drop)


def text() -> None:
    """An engine that reports no usage: every chunk's text counted."""
    meter, count = u.StreamMeter(), u.TextMeter()
    for chunk in [EVENT] * 64 + [DONE]:
        meter.feed(chunk)
        count.feed(chunk)
    meter.reported()
    count.tokens()


def main() -> None:
    current: list[Callable[[], None]] = [now, one_chunk, three_chunks, text]
    runs = current if hasattr(u, "TextMeter") else [before]
    rounds = 3000
    for run in runs:
        best = min(timeit.repeat(run, number=rounds, repeat=5)) / rounds * 1e6
        print(f"{run.__name__}: {best:.1f} us per 64-token stream")


if __name__ == "__main__":
    main()
