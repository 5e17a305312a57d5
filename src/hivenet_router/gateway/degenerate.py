"""Is a model's output degenerate? Three cheap signs of a model stuck in a loop, judged
incrementally over the text as it streams.

- Repeated n-grams: among the n-grams (runs of `ngram` words) of the recent text, the share
  that already occurred earlier in it. Prose repeats few 4-grams; a loop repeats nearly all.
  N-grams of markup alone (no letter or digit: `| --- |`, `} } }`) are not counted.
- A collapsing compression ratio: the recent text deflated, over its raw size. A loop
  deflates to almost nothing; this also sees loops without word boundaries (CJK text).
- The same chunk over and over: one text piece (one event's delta) many times in a row,
  until the run makes `max_same_chunk` words (text without spaces: LONGEST_WORD characters
  make one), once the text has `min_words` words.

Judging looks at a sliding window of the last words, so a loop that starts late is seen as
soon as it fills the window, not once it outweighs everything said before it, and the work
per word is constant: the n-gram share is kept up to date as words enter and leave the
window; the window is deflated only every `COMPRESS_EVERY` words (and when asked to settle).
Every check waits for `min_words` words: a few words prove nothing either way.

Pure: no I/O, no clock; the stream validator feeds it and asks for a verdict.
"""

from __future__ import annotations

import zlib
from collections import deque
from collections.abc import Iterable
from typing import Final

from hivenet_router.gateway.settings import ValidatorSettings

REPEATED_NGRAMS: Final = "repeated_ngrams"
LOW_COMPRESSION: Final = "low_compression"
SAME_CHUNK: Final = "same_chunk"

WINDOW_WORDS: Final = 128  # the recent text judged (at least 4 x min_words)
COMPRESS_EVERY: Final = 16  # words between two deflations of the window
LONGEST_WORD: Final = 16  # characters; text without spaces is cut into words this long


class Detector:
    """Feed it text pieces in order; `reason` is None while the text looks sound, else why
    it does not (and stays so: a loop once seen is not forgiven)."""

    __slots__ = (
        "_bare",
        "_count",
        "_counts",
        "_grams",
        "_judged",
        "_last",
        "_max_fraction",
        "_max_same",
        "_min_ratio",
        "_min_words",
        "_n",
        "_partial",
        "_run",
        "_since_deflate",
        "_stride",
        "_tail",
        "_words",
        "reason",
        "seen",
    )

    def __init__(self, settings: ValidatorSettings, stride: int = COMPRESS_EVERY) -> None:
        self._n = settings.ngram
        self._stride = stride
        self._max_fraction = settings.max_repeat_fraction
        self._min_ratio = settings.min_compression_ratio
        self._max_same = settings.max_same_chunk
        self._min_words = settings.min_words
        window = max(WINDOW_WORDS, 4 * settings.min_words, 2 * settings.ngram)
        self._words: deque[str] = deque(maxlen=window)
        self._tail: deque[str] = deque(maxlen=self._n)  # the last n words: the next n-gram
        # The window's n-grams, oldest first (None: one of markup alone, not counted).
        self._grams: deque[tuple[str, ...] | None] = deque()
        self._judged = 0  # the n-grams in _grams that are counted
        self._bare = 0  # the last words in a row without a letter or digit
        self._counts: dict[tuple[str, ...], int] = {}  # how often each is in the window
        self._partial = ""  # a word the last piece cut in two
        self._last: str | None = None  # the previous piece, for the same-chunk run
        self._count = 0  # pieces in the run
        self._run = 0.0  # the run's length in words (see _same)
        self._since_deflate = 0
        self.seen = 0  # words fed so far
        self.reason: str | None = None

    @property
    def degenerate(self) -> bool:
        return self.reason is not None

    def feed(self, piece: str) -> str | None:
        """Take the next piece of text; the reason the text is degenerate, or None."""
        if not piece or self.reason is not None:
            return self.reason
        for word in self._split(piece):
            self._add(word)
            if self.reason is not None:
                return self.reason
        self._same(piece)
        return self.reason

    def _same(self, piece: str) -> None:
        """The same-chunk run, measured in the words it makes, not in pieces: a zero address
        streamed as "000" thirteen times is one long word, not thirteen, and nine pieces of
        indentation make no word at all. Only a loop that the n-gram check reads slowly is
        left for this rule: one word (" over") or a piece without a boundary ("!") again
        and again. A piece of several words breaks the run: the n-grams judge those."""
        words = piece.split()
        if len(words) > 1:
            self._last, self._count, self._run = None, 0, 0.0
            return
        weight = self._weight(piece, words)
        if piece == self._last:
            self._count += 1
            self._run += weight
        else:
            self._last, self._count, self._run = piece, 1, weight
        limit = self._max_same
        if self._count >= limit and self._run >= limit and self.seen >= self._min_words:
            self.reason = SAME_CHUNK

    @staticmethod
    def _weight(piece: str, words: list[str]) -> float:
        """The words one piece of a run adds: one for a word with its boundary (" over"),
        else its share of a LONGEST_WORD cut (glued text such as "000", or whitespace)."""
        if words and len(words[0]) < len(piece):
            return 1.0
        return len(piece) / LONGEST_WORD

    def _split(self, piece: str) -> list[str]:
        """The words `piece` completes. A word longer than LONGEST_WORD is cut into pieces
        that long, counted from its start whatever the chunking, so text without spaces
        still makes words, and the same text makes the same words."""
        text = self._partial + piece if self._partial else piece
        words = text.split()
        self._partial = words.pop() if words and not text[-1].isspace() else ""
        out: list[str] = []
        for word in words:
            if len(word) > LONGEST_WORD:
                out.extend(word[i : i + LONGEST_WORD] for i in range(0, len(word), LONGEST_WORD))
            else:
                out.append(word)
        partial = self._partial
        if len(partial) > LONGEST_WORD:
            whole = len(partial) - len(partial) % LONGEST_WORD
            out.extend(partial[i : i + LONGEST_WORD] for i in range(0, whole, LONGEST_WORD))
            self._partial = partial[whole:]
        return out

    def feed_all(self, pieces: Iterable[str]) -> str | None:
        for piece in pieces:
            if self.feed(piece) is not None:
                break
        return self.reason

    def settle(self) -> str | None:
        """Judge the compression ratio now, whatever the stride (the end of a held window)."""
        if self.reason is None and self.seen >= self._min_words:
            self._deflate()
        return self.reason

    def finish(self) -> str | None:
        """The text is complete: its last word counts, then a final judgement."""
        if self._partial and self.reason is None:
            partial, self._partial = self._partial, ""
            self._add(partial)
        return self.settle()

    # -- the window -----------------------------------------------------------------------------

    def _add(self, word: str) -> None:
        words = self._words
        if len(words) == words.maxlen:
            self._drop_gram()
        words.append(word)
        self.seen += 1
        tail = self._tail
        tail.append(word)
        self._bare = 0 if any(map(str.isalnum, word)) else self._bare + 1
        if len(tail) == self._n:
            if self._bare >= self._n:
                # Markup alone ("| --- | ---", "} } } }") repeats by design: a blank table
                # or closing braces are no loop. A loop of it still deflates to nothing.
                self._grams.append(None)
            else:
                gram = tuple(tail)
                self._grams.append(gram)
                counts = self._counts
                counts[gram] = counts.get(gram, 0) + 1
                self._judged += 1
        self._since_deflate += 1
        if self.seen < self._min_words:
            return
        if self.repeat_fraction() > self._max_fraction:
            self.reason = REPEATED_NGRAMS
        elif self._since_deflate >= self._stride:
            self._deflate()

    def _drop_gram(self) -> None:
        """The oldest word leaves the window, and with it the oldest n-gram (keeping as many
        n-grams as the window's words make)."""
        grams = self._grams
        maxlen = self._words.maxlen or 0
        if grams and len(grams) > maxlen - self._n:
            gram = grams.popleft()
            if gram is None:
                return
            self._judged -= 1
            left = self._counts[gram] - 1
            if left:
                self._counts[gram] = left
            else:
                del self._counts[gram]

    def repeat_fraction(self) -> float:
        """The share of the window's n-grams that repeat an earlier one in it (n-grams of
        markup alone, words without a letter or digit, are not counted)."""
        total = self._judged
        if total == 0:
            return 0.0
        return (total - len(self._counts)) / total

    def compression_ratio(self) -> float:
        """The window's text deflated (raw deflate: no header to weigh on short text), over
        its size."""
        raw = " ".join(self._words).encode()
        if not raw:
            return 1.0
        packer = zlib.compressobj(6, zlib.DEFLATED, -15)
        return len(packer.compress(raw) + packer.flush()) / len(raw)

    def _deflate(self) -> None:
        self._since_deflate = 0
        if self._min_ratio > 0 and self.compression_ratio() < self._min_ratio:
            self.reason = LOW_COMPRESSION


def judge(text: str, settings: ValidatorSettings) -> str | None:
    """The verdict on a complete text (a whole answer): None when it looks sound."""
    # A whole text is judged in one go: deflating every half window bounds the work to a
    # few deflations per thousand words.
    detector = Detector(settings, stride=WINDOW_WORDS // 2)
    detector.feed(text)
    return detector.finish()
