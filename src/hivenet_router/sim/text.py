"""Deterministic text for the simulator: prompts flattened to bytes, answers cut from a corpus."""

from __future__ import annotations

import random
import zlib
from typing import Any

_WORDS = [
    "the",
    "model",
    "routes",
    "tokens",
    "across",
    "a",
    "fleet",
    "of",
    "engines",
    "while",
    "agents",
    "report",
    "load",
    "and",
    "the",
    "router",
    "keeps",
    "every",
    "slot",
    "accounted",
    "for",
    "so",
    "that",
    "streams",
    "finish",
    "cleanly",
    "under",
    "pressure",
    "with",
    "caches",
    "warm",
    "and",
    "queues",
    "short",
    "latency",
    "stays",
    "low",
    "when",
    "prefixes",
    "are",
    "shared",
    "between",
    "turns",
    "of",
    "a",
    "long",
    "conversation",
    "about",
    "capacity",
    "planning",
    "benchmarks",
    "and",
    "failure",
    "recovery",
    "in",
    "production",
]


class Corpus:
    """A fixed stream of tokens; an answer is a slice of it chosen by the prompt's hash."""

    def __init__(self, seed: int, size: int = 8192) -> None:
        rng = random.Random(seed)
        self.tokens = tuple(" " + rng.choice(_WORDS) for _ in range(size))
        self.seed = seed

    def answer(self, prompt: bytes, count: int, repeat: bool = False) -> list[str]:
        if repeat:
            return [(" over", " and")[i % 2] for i in range(count)]
        start = zlib.crc32(prompt, self.seed & 0xFFFFFFFF) % len(self.tokens)
        out: list[str] = []
        while len(out) < count:
            out.extend(self.tokens[start : start + count - len(out)])
            start = 0
        return out


def _content_text(content: Any, out: list[str]) -> None:
    if isinstance(content, str):
        out.append(content)
    elif isinstance(content, list):
        for part in content:
            if isinstance(part, dict):
                text = part.get("text")
                if isinstance(text, str):
                    out.append(text)
            elif isinstance(part, str):
                out.append(part)


def chat_prompt(body: dict[str, Any]) -> bytes:
    out: list[str] = []
    _content_text(body.get("system"), out)
    messages = body.get("messages")
    if isinstance(messages, list):
        for message in messages:
            if isinstance(message, dict):
                out.append(str(message.get("role", "")))
                _content_text(message.get("content"), out)
    tools = body.get("tools")
    if tools:
        out.append(str(tools))
    return "\n".join(out).encode()


def completion_prompt(body: dict[str, Any]) -> bytes:
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        return "\n".join(str(item) for item in prompt).encode()
    return str(prompt or "").encode()
