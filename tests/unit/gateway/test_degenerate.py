"""The degenerate-output detector: loops are seen, sound text never is.

The realistic samples below were written for these tests; the simulator's answers are the
text the integration tests stream.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Callable

import pytest

from hivenet_router.gateway.degenerate import (
    LOW_COMPRESSION,
    REPEATED_NGRAMS,
    SAME_CHUNK,
    Detector,
    judge,
)
from hivenet_router.gateway.settings import ValidatorSettings
from hivenet_router.sim.text import Corpus

# The defaults this module is tuned for (the lead's settings change: min_words 12 so that a
# 15-chunk hold of one-token chunks is judged; min_compression_ratio 0.1 so that a JSON
# list of similar records is not taken for a loop).
TUNED = ValidatorSettings(min_words=12, min_compression_ratio=0.1)


def off(min_words: int = 12, ngram: int = 4) -> ValidatorSettings:
    """Every check turned off (each at the end of its range)."""
    return ValidatorSettings(
        min_words=min_words,
        ngram=ngram,
        max_repeat_fraction=1.0,
        min_compression_ratio=0.0,
        max_same_chunk=100_000,
    )


PROSE = """\
Routing requests across a fleet of inference engines is mostly a question of bookkeeping.
Each engine reports how many sequences it is decoding, how much of its key-value cache is
free, and how long its recent answers took to start. The router weighs those figures
against the request in hand: a long prompt that shares a prefix with earlier traffic is
worth sending to the engine that already holds that prefix, even if another engine is a
little less busy. When an engine stops answering, its circuit breaker opens and traffic
moves elsewhere until a probe succeeds. None of this is glamorous, but getting it wrong
shows up immediately as queueing, timeouts, and users who give up and refresh the page.
A good operator watches the queue depth, the time to first token, and the error rate, and
raises capacity before any of them turns into an incident. In practice, the first sign of
trouble is usually a slow creep in latency at the ninetieth percentile, long before the
median moves at all, which is why dashboards should always show both side by side."""

CODE = '''\
def merge_intervals(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Merge overlapping intervals and return them sorted by start."""
    if not intervals:
        return []
    ordered = sorted(intervals)
    merged = [ordered[0]]
    for start, end in ordered[1:]:
        last_start, last_end = merged[-1]
        if start <= last_end:
            merged[-1] = (last_start, max(last_end, end))
        else:
            merged.append((start, end))
    return merged


def test_merge_intervals() -> None:
    assert merge_intervals([]) == []
    assert merge_intervals([(1, 3)]) == [(1, 3)]
    assert merge_intervals([(1, 3), (2, 6)]) == [(1, 6)]
    assert merge_intervals([(1, 2), (3, 4)]) == [(1, 2), (3, 4)]
    assert merge_intervals([(5, 7), (1, 2), (2, 5)]) == [(1, 7)]
'''

TABLE = """\
| Region | Engine | Capacity | p50 TTFT (ms) | p90 TTFT (ms) | Error rate |
| --- | --- | --- | --- | --- | --- |
| eu-west | vLLM | 64 | 180 | 420 | 0.2% |
| eu-west | SGLang | 48 | 165 | 390 | 0.1% |
| us-east | vLLM | 128 | 210 | 510 | 0.4% |
| us-east | TGI | 32 | 240 | 640 | 0.9% |
| ap-south | vLLM | 16 | 260 | 700 | 1.1% |
| ap-south | llama.cpp | 8 | 410 | 1200 | 2.3% |
"""

JSON_LIST = ", ".join(
    f'{{"id": {i}, "name": "worker-{i:02d}", "zone": "{"abc"[i % 3]}", '
    f'"healthy": {"true" if i % 4 else "false"}}}'
    for i in range(24)
)

STEPS = """\
1. Install the agent on each machine that runs an engine.
2. Copy the shared secret into the agent's configuration file.
3. Point the agent at the engine's local address and port.
4. Start the agent and check that it registers with the router.
5. Send a test request through the router and read the audit log.
6. Repeat the last step with streaming turned on to check the relay.
7. Watch the metrics page for the new agent's capacity and health.
8. Add the agent's region to the policy if requests should prefer it.
"""

POEM = """\
Row, row, row the boat along the river slow,
past the mill and past the bridge where the willows grow;
row, row, row the boat until the evening light,
then we tie it to the post and walk home for the night.
Row, row, row the boat again when morning comes,
past the field where children play and someone beats the drums."""

CJK = (
    "路由器负责把请求分配给不同的推理引擎。每个引擎都会报告自己正在处理的序列数量、"
    "缓存的剩余空间以及最近的响应时间。如果某个引擎长时间没有回应，路由器会暂时停止向它发送流量，"  # noqa: RUF001
    "直到探测请求再次成功。运维人员应当关注队列长度、首个令牌的延迟和错误率，"  # noqa: RUF001
    "在问题变成事故之前及时扩容。"
)

GERMAN = """\
Der Router verteilt Anfragen auf mehrere Inferenzmaschinen. Jede Maschine meldet, wie viele
Sequenzen sie gerade bearbeitet, wie viel Speicher noch frei ist und wie lange die letzten
Antworten gedauert haben. Fällt eine Maschine aus, öffnet sich ihr Schutzschalter, und der
Verkehr wandert zu den anderen, bis eine Probeanfrage wieder gelingt. Wer den Betrieb
verantwortet, beobachtet die Warteschlange, die Zeit bis zum ersten Token und die Fehlerquote."""


IDENTITY = "\n".join(" ".join("1" if i == j else "0" for j in range(8)) for i in range(8))
UNIFORM_JSON = ", ".join(f'{{"id": {i}, "ok": true}}' for i in range(40))
CSV = "\n".join(f"{i},{i * 3 % 17},{i * 7 % 23},{i / 7:.2f}" for i in range(40))
REALISTIC = {
    "prose": PROSE,
    "code": CODE,
    "table": TABLE,
    "json": JSON_LIST,
    "uniform_json": UNIFORM_JSON,
    "csv": CSV,
    "steps": STEPS,
    "poem": POEM,
    "cjk": CJK,
    "german": GERMAN,
}


def tokens(text: str) -> list[str]:
    """Pieces the way a tokenizer streams them: words with their leading space, runs of
    punctuation, whitespace."""
    return re.findall(r"\s*\w+|\s*[^\w\s]+|\s+", text)


def fine_tokens(text: str) -> list[str]:
    """Smaller pieces, as some tokenizers stream code: digits in threes, each newline and
    each level of indentation alone, one punctuation mark at a time."""
    return re.findall(r"\d{1,3}|\n|[ ]{2,4}|[ ]?[^\W\d]+|[ ]?[^\w\s]|\s", text)


# Code and data that repeat themselves by nature: none of it is a loop.
NESTED_JSON = (
    "{\n"
    + "".join("  " * i + f'"level{i}": {{\n' for i in range(1, 10))
    + "  " * 10
    + '"leaf": true\n'
    + "".join("  " * i + "}\n" for i in range(9, -1, -1))
)
DEEP_CODE = (
    "def check(x):\n"
    + "".join("    " * i + f"if x.get('k{i}'):\n" for i in range(1, 10))
    + "    " * 10
    + "return True\n"
    + "    return False\n"
)
BRACKETS = (
    f"Nested: {'[' * 16}1{']' * 16}, calls: {'f(' * 12}x{')' * 12}, and a minified end "
    f"{'}' * 24} closes it all."
)
WIDE_TABLE = (
    "| "
    + " | ".join(f"q{i}" for i in range(16))
    + " |\n|"
    + " --- |" * 16
    + "\n"
    + "\n".join("| " + " | ".join(str(r * 16 + c) for c in range(16)) + " |" for r in range(4))
)
BLANK_FORM = (
    "| Name | Date | Signature | Notes |\n| --- | --- | --- | --- |\n" + "|  |  |  |  |\n" * 8
)
SEPARATOR_ROWS = "| --- | --- | --- | --- |\n" * 6  # held-window case only: the rows repeat whole
BASE64 = (
    "The key is "
    + base64.b64encode(bytes((i * 73 + 41) % 256 for i in range(240))).decode()
    + " and the header, mostly zero bytes, is "
    + base64.b64encode(b"\x89PNG" + bytes(60) + b"\x01\x02").decode()
    + "."
)
NUMBERS = (
    f"Two to the 256th is {2**256}, a googol is 1{'0' * 100}, the zero address is "
    f"0x{'0' * 40}, and pi starts 3.14159265358979323846264338327950288419716939937510."
)
CODE_LIKE = {
    "nested_json": NESTED_JSON,
    "deep_code": DEEP_CODE,
    "brackets": BRACKETS,
    "wide_table": WIDE_TABLE,
    "blank_form": BLANK_FORM,
    "base64": BASE64,
    "numbers": NUMBERS,
}


def loop(count: int) -> list[str]:
    """The simulator's degenerate answer (--fault-repeat-rate): " over and over and ..."."""
    return [(" over", " and")[i % 2] for i in range(count)]


def flagged_at(detector: Detector, pieces: list[str]) -> int:
    """How many pieces it took the detector to flag the text (a failure if it never did)."""
    for count, piece in enumerate(pieces, start=1):
        if detector.feed(piece) is not None:
            return count
    raise AssertionError("never flagged")


def scan(pieces: list[str], settings: ValidatorSettings = TUNED) -> tuple[float, float]:
    """The highest n-gram repeat share and the lowest compression ratio the detector sees
    anywhere in the text once it judges (checks off, so it reads to the end)."""
    detector = Detector(off(settings.min_words, settings.ngram))
    worst_fraction, worst_ratio = 0.0, 1.0
    for piece in pieces:
        detector.feed(piece)
        if detector.seen >= settings.min_words:
            worst_fraction = max(worst_fraction, detector.repeat_fraction())
            worst_ratio = min(worst_ratio, detector.compression_ratio())
    detector.finish()
    return worst_fraction, worst_ratio


def test_the_defaults_are_the_tuned_ones() -> None:
    """Fails until gateway/settings.py takes the tuned defaults (see the module's note)."""
    assert ValidatorSettings() == TUNED


@pytest.mark.parametrize("length", [4, 12, 15, 24, 64, 256, 1024, 4000])
def test_simulator_answers_are_never_flagged(length: int) -> None:
    corpus = Corpus(7)
    for index in range(200 if length < 1000 else 20):
        pieces = corpus.answer(f"prompt {index} of {length}".encode(), length)
        detector = Detector(TUNED)
        assert detector.feed_all(pieces) is None and detector.finish() is None, index


def test_simulator_answers_keep_wide_margins() -> None:
    corpus = Corpus(7)
    fractions, ratios = [], []
    for index in range(300):
        fraction, ratio = scan(corpus.answer(f"margin {index}".encode(), 200))
        fractions.append(fraction)
        ratios.append(ratio)
    assert max(fractions) <= 0.05 < TUNED.max_repeat_fraction  # measured: 0
    assert min(ratios) >= 0.3 > TUNED.min_compression_ratio  # measured: 0.36


@pytest.mark.parametrize("name", sorted(REALISTIC))
def test_realistic_text_is_never_flagged(name: str) -> None:
    text = REALISTIC[name]
    detector = Detector(TUNED)
    assert detector.feed_all(tokens(text)) is None
    assert detector.finish() is None
    assert judge(text, TUNED) is None  # and in one piece, as a whole answer
    fraction, ratio = scan(tokens(text))
    # Margins measured: the table repeats 0.29 of its n-grams (limit 0.6); the uniform
    # JSON list deflates to 0.135 (limit 0.1).
    assert fraction < 0.35 and ratio > 0.12


def test_the_simulators_loop_is_seen_within_a_15_chunk_hold() -> None:
    detector = Detector(TUNED)
    assert flagged_at(detector, loop(15)) <= 13
    assert (
        detector.reason == REPEATED_NGRAMS
    )  # 12 words judged: 7 of 9 four-grams repeat (0.78 > 0.6)


def test_repeated_ngrams_of_a_longer_phrase() -> None:
    phrase = " I am not sure what you mean by that question."
    detector = Detector(TUNED)
    assert detector.feed_all(tokens(phrase * 3)) == REPEATED_NGRAMS


def test_a_loop_that_starts_late_is_seen_by_the_window() -> None:
    """The window is the last 128 words: a loop after 1,000 clean words is seen well
    before it outweighs them."""
    clean = Corpus(7).answer(b"a long answer", 1000)
    detector = Detector(TUNED)
    assert detector.feed_all(clean) is None
    assert flagged_at(detector, loop(400)) < 200
    assert detector.reason == REPEATED_NGRAMS


def test_collapsing_compression_is_seen_without_word_boundaries() -> None:
    """A loop in text without spaces makes no repeated words the n-gram check can count
    early; its compression ratio collapses."""
    settings = ValidatorSettings(min_words=12, min_compression_ratio=0.1, max_repeat_fraction=1.0)
    text = "我不知道答案。" * 60
    assert judge(text, settings) == LOW_COMPRESSION
    assert judge(CJK * 3, settings) is None  # sound CJK text, even said three times


def test_the_same_chunk_over_and_over() -> None:
    """A run counts the words it makes, once the text has min_words words."""
    words = tokens(PROSE)[: TUNED.min_words]
    detector = Detector(TUNED)
    assert detector.feed_all(words) is None
    assert flagged_at(detector, [" again"] * 20) == TUNED.max_same_chunk
    assert detector.reason == SAME_CHUNK
    # Glued text: 16 characters make a word, so "!" takes 8 x 16 pieces.
    glued = Detector(TUNED)
    glued.feed_all(words)
    assert flagged_at(glued, ["!"] * 200) == TUNED.max_same_chunk * 16
    assert glued.reason == SAME_CHUNK
    # Empty pieces (role deltas, keep-alives) neither count nor break a run.
    other = Detector(TUNED)
    for _ in range(20):
        assert other.feed("") is None
    assert other.feed_all(["a", "b"] * 10) is None  # alternating is no run (n-grams judge it)


def test_the_same_chunk_waits_for_min_words() -> None:
    """The reviewer's case: a zero address streamed as "000" thirteen times, five words
    in, is no loop; nor are nine pieces of indentation after a table's separator row."""
    zero = ["Use", " the", " zero", " address", " `", "0", "x", *["000"] * 13, "0", "`"]
    detector = Detector(TUNED)
    assert detector.feed_all([*zero, " as", " the", " burn", " address", "."]) is None
    assert detector.finish() is None
    indent = Detector(TUNED)
    assert indent.feed_all(["|", *["---", "|"] * 6, "\n", *["  "] * 9]) is None
    assert indent.finish() is None
    early = Detector(TUNED)  # eight words, but fewer than min_words in all
    assert early.feed_all([" again"] * (TUNED.min_words - 1)) is None


def test_whitespace_and_several_words_make_no_run() -> None:
    words = tokens(PROSE)[: TUNED.min_words]
    detector = Detector(TUNED)
    detector.feed_all(words)
    assert detector.feed_all(["    "] * 20 + ["\n"] * 20) is None  # 5 and 1.25 words
    assert detector.feed_all([" --- |"] * 30) is None  # n-grams of markup: not counted
    # A whitespace loop is still seen once it makes max_same_chunk words (128 newlines).
    assert flagged_at(detector, ["\n"] * 200) == TUNED.max_same_chunk * 16


@pytest.mark.parametrize("split", [tokens, fine_tokens], ids=["tokens", "fine"])
@pytest.mark.parametrize("name", sorted(CODE_LIKE))
def test_code_and_data_are_never_flagged(name: str, split: Callable[[str], list[str]]) -> None:
    text = CODE_LIKE[name]
    pieces = split(text)
    detector = Detector(TUNED)
    assert detector.feed_all(pieces) is None and detector.finish() is None
    assert judge(text, TUNED) is None
    fraction, ratio = scan(pieces)
    assert fraction < 0.35 and ratio > 0.12  # measured: 0.06 and 0.29 at worst


@pytest.mark.parametrize("split", [tokens, fine_tokens], ids=["tokens", "fine"])
@pytest.mark.parametrize("name", [*sorted(CODE_LIKE), "separator_rows"])
def test_code_and_data_pass_the_held_window(name: str, split: Callable[[str], list[str]]) -> None:
    """What the validator judges in a 15-chunk hold of one-token chunks."""
    text = SEPARATOR_ROWS if name == "separator_rows" else CODE_LIKE[name]
    pieces = split(text)[: ValidatorSettings().hold_chunks]
    detector = Detector(TUNED)
    assert detector.feed_all(pieces) is None and detector.settle() is None


def test_short_text_is_not_judged() -> None:
    settings = ValidatorSettings(min_words=12)
    assert judge(" over and over and over", settings) is None  # 5 words
    assert judge("yes yes yes yes yes yes yes yes yes yes yes", settings) is None  # 11
    assert judge("yes yes yes yes yes yes yes yes yes yes yes yes", settings) == REPEATED_NGRAMS


def test_a_verdict_stays() -> None:
    detector = Detector(TUNED)
    detector.feed_all(loop(40))
    assert detector.degenerate
    assert detector.feed_all(Corpus(7).answer(b"x", 300)) == REPEATED_NGRAMS


def test_words_cut_across_pieces_count_once() -> None:
    whole = Detector(TUNED)
    whole.feed("the router keeps every slot accounted")
    whole.finish()
    split = Detector(TUNED)
    split.feed_all(["the rou", "ter kee", "ps every sl", "ot acc", "ounted"])
    split.finish()
    assert whole.seen == split.seen == 6


def test_checks_can_be_turned_off() -> None:
    settings = off()
    assert judge(" over and" * 200, settings) is None


def test_known_false_positive_long_runs_of_one_number() -> None:
    """Documented limit: a matrix of zeros looks like a loop (docs/validator.md)."""
    assert judge(IDENTITY, TUNED) is not None
