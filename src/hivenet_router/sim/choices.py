"""OpenAI's `n`: several choices of one answer, as an engine gives them.

Every choice carries the same tokens (the simulator's text is drawn, not sampled), each
under its own index, and usage counts the output of all of them, as vLLM and OpenAI do.
"""

from __future__ import annotations

import orjson

from hivenet_router.sim.formats import Format

_FIRST = b'"choices":[{"index":0,'
_DONE = b"data: [DONE]\n\n"


def _at(events: bytes, index: int) -> bytes:
    return events.replace(_FIRST, b'"choices":[{"index":%d,' % index)


class Choices:
    """A Format that writes `n` choices where the one it wraps writes one. Token counts
    handed to it are per choice."""

    def __init__(self, inner: Format, n: int) -> None:
        self.inner = inner
        self.n = n

    def whole(self, text: str, finish: str, prompt_tokens: int, completion_tokens: int) -> bytes:
        doc = orjson.loads(
            self.inner.whole(text, finish, prompt_tokens, completion_tokens * self.n)
        )
        first = doc["choices"][0]
        doc["choices"] = [{**first, "index": index} for index in range(self.n)]
        return orjson.dumps(doc)

    def stream_start(self, prompt_tokens: int) -> bytes:
        start = self.inner.stream_start(prompt_tokens)
        return b"".join(_at(start, index) for index in range(self.n))

    def stream_token(self, token: str) -> bytes:
        piece = self.inner.stream_token(token)
        return b"".join(_at(piece, index) for index in range(self.n))

    def stream_end(
        self, finish: str, prompt_tokens: int, completion_tokens: int, include_usage: bool
    ) -> bytes:
        total = completion_tokens * self.n
        last = self.inner.stream_end(finish, prompt_tokens, total, include_usage)
        alone = self.inner.stream_end(finish, prompt_tokens, total, False).removesuffix(_DONE)
        return b"".join(_at(alone, index) for index in range(1, self.n)) + last
