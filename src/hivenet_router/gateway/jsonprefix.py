"""Can this text still become JSON? An incremental checker for a JSON document that arrives
in pieces: it finds the first character that no continuation could make valid (RFC 8259),
and tells when the document is complete.

Fed piece by piece, it keeps only its state (a stack of open containers and where it is in
the current token), never the text: each character is looked at once, so the work is linear
in the text however it is cut. Runs of string characters, whitespace and digits are skipped
with a regular expression rather than one character at a time.

Pure: no I/O; the stream validator's syntax judge (gateway/syntax.py) feeds it.
"""

from __future__ import annotations

import re
from typing import Final

# Where the checker is: what the next character may be.
VALUE: Final = 0  # a value (the document's start, after ':' or after ',' in an array)
ARRAY_FIRST: Final = 1  # a value or ']' (just after '[')
OBJECT_FIRST: Final = 2  # a key or '}' (just after '{')
KEY: Final = 3  # a key (after ',' in an object)
COLON: Final = 4
AFTER: Final = 5  # ',' or the container's closer
STRING: Final = 6
ESCAPE: Final = 7  # after a backslash in a string
HEX: Final = 8  # inside \uXXXX
LITERAL: Final = 9  # inside true, false or null
MINUS: Final = 10  # a number's '-': a digit must follow
ZERO: Final = 11  # a number's leading 0: '.', 'e' or its end
INTEGER: Final = 12
DOT: Final = 13  # a digit must follow
FRACTION: Final = 14
EXP: Final = 15  # after 'e': a sign or a digit
EXP_SIGN: Final = 16  # a digit must follow
EXPONENT: Final = 17
DONE: Final = 18  # the document is complete: only whitespace may follow

# A number may end here (the next character is not part of it).
_NUMBER_ENDS: Final = frozenset({ZERO, INTEGER, FRACTION, EXPONENT})
_WHITESPACE: Final = " \t\n\r"
_HEX_DIGITS: Final = frozenset("0123456789abcdefABCDEF")
_ESCAPES: Final = frozenset('"\\/bfnrtu')
_LITERALS: Final = {"t": "rue", "f": "alse", "n": "ull"}
_OPENER: Final = {"}": "{", "]": "["}
_STRING_RUN: Final = re.compile(r'[^"\\\x00-\x1f]+')
_SPACE_RUN: Final = re.compile(r"[ \t\n\r]+")
_DIGIT_RUN: Final = re.compile(r"[0-9]+")


class JsonPrefix:
    """Feed it the text in pieces; `error` is None while the text read so far can still
    become one JSON document, else the offset (in characters, from the document's start)
    of the first character that cannot. Once broken it stays broken."""

    __slots__ = ("_hex", "_key", "_literal", "_object_only", "_stack", "error", "seen", "state")

    def __init__(self, object_only: bool = False) -> None:
        self._stack: list[str] = []  # the open containers: '{' or '['
        self._key = False  # the string being read is an object's key
        self._literal = ""  # what is left of true, false or null
        self._hex = 0  # hex digits left of a \u escape
        self._object_only = object_only  # the document must be an object (json_object)
        self.state = VALUE
        self.seen = 0  # characters fed so far
        self.error: int | None = None

    @property
    def complete(self) -> bool:
        """Is the text so far one whole document (more may still follow for a number)?"""
        return self.error is None and (
            self.state == DONE or (not self._stack and self.state in _NUMBER_ENDS)
        )

    @property
    def depth(self) -> int:
        return len(self._stack)

    def feed(self, text: str) -> int | None:
        """Run over `text` from the current state; the error's offset, or None."""
        if self.error is not None or not text:
            return self.error
        i, n = 0, len(text)
        state = self.state
        stack = self._stack
        while i < n:
            if state == STRING:
                run = _STRING_RUN.match(text, i)
                if run is not None:
                    i = run.end()
                    if i >= n:
                        break
                c = text[i]
                if c == '"':
                    state = COLON if self._key else AFTER if stack else DONE
                elif c == "\\":
                    state = ESCAPE
                else:
                    return self._stop(i, n, state)  # a control character inside a string
                i += 1
                continue
            c = text[i]
            # The common characters first, each where it is plainly right; anything else
            # (or any of them elsewhere) goes the general way below.
            if c == '"' and state <= KEY:  # a string starts: a key or a value
                self._key = state >= OBJECT_FIRST
                if not self._key and self._object_only and not stack:
                    return self._stop(i, n, state)
                state = STRING
            elif c == ":" and state == COLON:
                state = VALUE
            elif c == "," and state == AFTER:
                state = KEY if stack[-1] == "{" else VALUE
            elif c == "{" and state <= ARRAY_FIRST:
                stack.append(c)
                state = OBJECT_FIRST
            elif state == AFTER and c in _OPENER and stack[-1] == _OPENER[c]:
                stack.pop()
                state = AFTER if stack else DONE
            elif state == DONE or (state < STRING and c in _WHITESPACE):
                run = _SPACE_RUN.match(text, i)
                if run is None:
                    return self._stop(i, n, state)  # something after the complete document
                i = run.end()
                continue
            elif state >= MINUS:
                state, advance = self._number(state, text, i)
                if state < 0:
                    return self._stop(i, n, state)
                i += advance
                continue
            elif state <= KEY:
                state = self._open(state, c)
                if state < 0:
                    return self._stop(i, n, state)
            else:
                state = self._inside(state, c)
                if state < 0:
                    return self._stop(i, n, state)
            i += 1
        self.state = state
        self.seen += n
        return None

    def _stop(self, i: int, n: int, state: int) -> int:
        self.state = state
        self.error = self.seen + i
        self.seen += n
        return self.error

    def _after(self) -> int:
        """Where a value that just ended leaves the checker."""
        return AFTER if self._stack else DONE

    def _open(self, state: int, c: str) -> int:
        """A value or key starts (or a container closes at once); -1 when `c` cannot."""
        if state in (KEY, OBJECT_FIRST):
            if c == '"':
                self._key = True
                return STRING
            if c == "}" and state == OBJECT_FIRST:
                self._stack.pop()
                return self._after()
            return -1
        if c == "]" and state == ARRAY_FIRST:
            self._stack.pop()
            return self._after()
        if self._object_only and not self._stack and c != "{":
            return -1
        if c in {"{", "["}:
            self._stack.append(c)
            return OBJECT_FIRST if c == "{" else ARRAY_FIRST
        if c == '"':
            self._key = False
            return STRING
        if c == "-":
            return MINUS
        if c == "0":
            return ZERO
        if "1" <= c <= "9":
            return INTEGER
        rest = _LITERALS.get(c)
        if rest is not None:
            self._literal = rest
            return LITERAL
        return -1

    def _inside(self, state: int, c: str) -> int:
        """After a key, a value, or inside an escape or a literal; -1 when `c` cannot be."""
        if state == COLON:
            return VALUE if c == ":" else -1
        if state == AFTER:
            top = self._stack[-1]
            if c == ",":
                return KEY if top == "{" else VALUE
            if (c == "}" and top == "{") or (c == "]" and top == "["):
                self._stack.pop()
                return self._after()
            return -1
        if state == ESCAPE:
            if c not in _ESCAPES:
                return -1
            if c == "u":
                self._hex = 4
                return HEX
            return STRING
        if state == HEX:
            if c not in _HEX_DIGITS:
                return -1
            self._hex -= 1
            return STRING if self._hex == 0 else HEX
        # LITERAL
        rest = self._literal
        if c != rest[0]:
            return -1
        self._literal = rest[1:]
        return LITERAL if self._literal else self._after()

    def _number(self, state: int, text: str, i: int) -> tuple[int, int]:
        """The next state inside a number and how many characters it took (0: the number
        ended before `text[i]`, which is read again in the state after it); -1 when bad."""
        c = text[i]
        if "0" <= c <= "9":
            if state == ZERO:
                return -1, 0  # no leading zeros
            run = _DIGIT_RUN.match(text, i)
            taken = run.end() - i if run is not None else 1
            if state == MINUS:
                if c == "0":
                    return ZERO, 1
                return INTEGER, taken
            if state == DOT:
                return FRACTION, taken
            if state in (EXP, EXP_SIGN):
                return EXPONENT, taken
            return state, taken  # INTEGER, FRACTION, EXPONENT go on
        if c == "." and (state in (ZERO, INTEGER)):
            return DOT, 1
        if c in "eE" and state in (ZERO, INTEGER, FRACTION):
            return EXP, 1
        if c in "+-" and state == EXP:
            return EXP_SIGN, 1
        if state in _NUMBER_ENDS:
            return self._after(), 0  # the number ended; `c` is read in the state after it
        return -1, 0

    def finish(self) -> str | None:
        """The text is over: None when it is one whole document, else why not."""
        if self.error is not None:
            return f"invalid JSON at character {self.error}"
        if self.complete:
            return None
        if self.seen == 0:
            return "no JSON at all"
        return "the JSON ends unfinished"
