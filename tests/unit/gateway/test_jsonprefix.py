"""The incremental JSON prefix checker against an independent oracle: a plain recursive
descent parser that treats the end of the text as "could still go on".

Properties: a valid document, cut into pieces anywhere, is never judged broken and is
complete at its end; any text (valid documents with one character changed, or noise from
JSON's alphabet), cut anywhere, is judged broken exactly at the first character the oracle
cannot read, and the cut never changes the verdict.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from hivenet_router.gateway.jsonprefix import JsonPrefix


class _End(Exception):
    """The text ran out where more could follow."""


class _Bad(Exception):
    def __init__(self, at: int) -> None:
        self.at = at


class Oracle:
    """('complete' | 'partial' | 'bad', index of the first bad character or None)."""

    def __init__(self, text: str, object_only: bool = False) -> None:
        self.s, self.i, self.object_only = text, 0, object_only

    def verdict(self) -> tuple[str, int | None]:
        top_number = False
        try:
            self.space()
            if self.object_only and self.peek() != "{":
                raise _Bad(self.i)
            top_number = self.peek() in "-0123456789"
            self.value()
            self.space()
            if self.i < len(self.s):
                raise _Bad(self.i)
            return "complete", None
        except _End:
            # A top-level number that ran out after a digit is already a whole document.
            if top_number and self._number_whole():
                return "complete", None
            return "partial", None
        except _Bad as bad:
            return "bad", bad.at

    def _number_whole(self) -> bool:
        return self.s.rstrip()[-1:].isdigit() and self.s == self.s.rstrip()

    def peek(self) -> str:
        if self.i >= len(self.s):
            raise _End
        return self.s[self.i]

    def take(self, allowed: str) -> str:
        c = self.peek()
        if c not in allowed:
            raise _Bad(self.i)
        self.i += 1
        return c

    def space(self) -> None:
        while self.i < len(self.s) and self.s[self.i] in " \t\n\r":
            self.i += 1

    def value(self) -> None:
        c = self.peek()
        if c == "{":
            self.i += 1
            self.space()
            if self.peek() == "}":
                self.i += 1
                return
            while True:
                self.space()
                self.take('"')
                self.string_rest()
                self.space()
                self.take(":")
                self.space()
                self.value()
                self.space()
                if self.take(",}") == "}":
                    return
        elif c == "[":
            self.i += 1
            self.space()
            if self.peek() == "]":
                self.i += 1
                return
            while True:
                self.space()
                self.value()
                self.space()
                if self.take(",]") == "]":
                    return
        elif c == '"':
            self.i += 1
            self.string_rest()
        elif c in "-0123456789":
            self.number()
        else:
            for word in ("true", "false", "null"):
                if c == word[0]:
                    for letter in word:
                        self.take(letter)
                    return
            raise _Bad(self.i)

    def string_rest(self) -> None:
        while True:
            c = self.peek()
            if c == '"':
                self.i += 1
                return
            if ord(c) < 0x20:
                raise _Bad(self.i)
            self.i += 1
            if c == "\\":
                e = self.take('"\\/bfnrtu')
                if e == "u":
                    for _ in range(4):
                        self.take("0123456789abcdefABCDEF")

    def digits(self) -> None:
        self.take("0123456789")
        while self.i < len(self.s) and self.s[self.i].isdigit() and self.s[self.i].isascii():
            self.i += 1

    def number(self) -> None:
        if self.peek() == "-":
            self.i += 1
        if self.peek() == "0":
            self.i += 1
        else:
            self.digits()
        if self.i < len(self.s) and self.s[self.i] == ".":
            self.i += 1
            self.digits()
        if self.i < len(self.s) and self.s[self.i] in "eE":
            self.i += 1
            if self.peek() in "+-":
                self.i += 1
            self.digits()
        if self.i >= len(self.s):
            raise _End  # a number may go on


def judged(text: str, cuts: list[int], object_only: bool = False) -> JsonPrefix:
    checker = JsonPrefix(object_only)
    start = 0
    for cut in sorted(set(cuts)):
        checker.feed(text[start:cut])
        start = cut
    checker.feed(text[start:])
    return checker


def expect(text: str, cuts: list[int], object_only: bool = False) -> None:
    kind, at = Oracle(text, object_only).verdict()
    checker = judged(text, cuts, object_only)
    assert checker.error == at, (text, cuts, kind, at, checker.error)
    if kind != "bad":
        assert checker.complete == (kind == "complete"), (text, kind)
        assert (checker.finish() is None) == (kind == "complete"), text


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**20), max_value=10**20)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=6), inner, max_size=5)
    ),
    max_leaves=25,
)


@st.composite
def documents(draw: st.DrawFn) -> str:
    value: Any = draw(json_values)
    indent = draw(st.sampled_from([None, 0, 2]))
    separators = draw(st.sampled_from([(",", ":"), (", ", ": "), (" , ", " :\t")]))
    if indent is not None:
        separators = (separators[0].rstrip(), separators[1])
    text = json.dumps(value, indent=indent, separators=separators, ensure_ascii=draw(st.booleans()))
    return (
        draw(st.sampled_from(["", " ", "\n"])) + text + draw(st.sampled_from(["", "\n", " \r\n"]))
    )


def cuts_for(text: str) -> st.SearchStrategy[list[int]]:
    return st.lists(st.integers(min_value=0, max_value=len(text)), max_size=12)


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_valid_documents_at_any_cut_are_never_broken(data: st.DataObject) -> None:
    text = data.draw(documents())
    cuts = data.draw(cuts_for(text))
    checker = judged(text, cuts)
    assert checker.error is None
    assert checker.complete and checker.finish() is None
    # Every prefix, too, can still become JSON (and only the whole one is complete,
    # unless the document is a bare number).
    for end in range(0, len(text), max(1, len(text) // 40)):
        prefix = judged(text[:end], cuts=[c for c in cuts if c <= end])
        assert prefix.error is None, (text, end)


ALPHABET = '{}[],:"\\ \n\t\x010123456789.eE+-truefalsnlxu/'


@settings(max_examples=600, deadline=None)
@given(st.data())
def test_a_changed_document_breaks_at_the_first_bad_character(data: st.DataObject) -> None:
    text = data.draw(documents())
    at = data.draw(st.integers(min_value=0, max_value=len(text)))
    change = data.draw(st.sampled_from(["insert", "replace", "delete"]))
    c = data.draw(st.sampled_from(ALPHABET))
    if change == "insert":
        text = text[:at] + c + text[at:]
    elif change == "replace":
        text = text[:at] + c + text[at + 1 :]
    else:
        text = text[:at] + text[at + 1 :]
    expect(text, data.draw(cuts_for(text)))


@settings(max_examples=600, deadline=None)
@given(st.data())
def test_noise_breaks_where_the_oracle_says(data: st.DataObject) -> None:
    text = data.draw(st.text(alphabet=ALPHABET, max_size=40))
    object_only = data.draw(st.booleans())
    expect(text, data.draw(cuts_for(text)), object_only)


def test_examples() -> None:
    cases = {
        '{"a": [1, 2.5e-3, true, null, "x\\u00e9"]}': None,
        '{"a" 1}': 5,
        "[1,]": 3,
        "tru": None,
        "trux": 3,
        "01": 1,
        "[01]": 2,
        '"a\x01"': 2,
        '{"a": 1}}': 8,
        '{"a": "\\q"}': 8,
        "-": None,
        "-a": 1,
        "1.e": 2,
    }
    for text, at in cases.items():
        assert judged(text, []).error == at, text
    assert judged('{"a":', [3]).finish() == "the JSON ends unfinished"
    assert judged("", []).finish() == "no JSON at all"
    assert judged("[1]", [], object_only=True).error == 0
    assert judged("  {}", [1], object_only=True).complete


def test_work_is_linear_in_the_text() -> None:
    """A long string value fed a character at a time is read once: the checker keeps no
    text, only its state."""
    checker = JsonPrefix()
    checker.feed('{"k": "')
    for _ in range(20_000):
        checker.feed("a")
    checker.feed('"}')
    assert checker.complete
    assert not hasattr(checker, "__dict__")
