"""API keys: generation, hashing, and constant-time checks."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

PREFIX = "sk-hivenet-"


def digest(raw: str) -> bytes:
    return hashlib.sha256(raw.encode()).digest()


def preview(raw: str) -> str:
    return f"{raw[:6]}...{raw[-4:]}"


@dataclass(frozen=True, slots=True)
class NewKey:
    raw: str
    sha256: str
    preview: str


def generate() -> NewKey:
    raw = PREFIX + secrets.token_urlsafe(32)
    return NewKey(raw, digest(raw).hex(), preview(raw))


class DigestSet:
    """Known key digests; raw keys are never kept.

    A presented key is hashed and compared with every stored digest by
    `hmac.compare_digest`, without stopping at a match, so the time taken says nothing about
    which key (if any) matched. Static and administrator key lists are short; the dynamic
    registry, when it comes, will want an index instead.
    """

    def __init__(self, entries: dict[bytes, object]) -> None:
        self._entries = list(entries.items())

    def find(self, raw: str) -> object | None:
        presented = digest(raw)
        found: object | None = None
        for stored, value in self._entries:
            if hmac.compare_digest(stored, presented):
                found = value
        return found

    def __len__(self) -> int:
        return len(self._entries)
