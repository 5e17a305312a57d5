"""The response cache's key, and what a request says about being cached.

The key is a SHA-256 over the route, the model, the tenant (left out when the policy shares
the cache between tenants), the few headers that change an answer's shape, and the body
normalised: parsed and written again with sorted keys and no whitespace, so two bodies that
differ only in key order or spacing get one key. Numbers are kept as written (`0` and `0.0`
are two keys), as are string contents.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

import orjson

# Routes whose answers are sampled: repeatable only with temperature 0 or a seed. Embeddings,
# rerank scores and token counts are the same every time.
SAMPLING_ROUTES: Final = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/messages"})
# Request headers that change what an engine or a provider answers (Anthropic's API version
# and beta features); every other forwarded header is left out of the key.
KEYED_HEADERS: Final = ("anthropic-version", "anthropic-beta")
_SEP: Final = b"\x00"


@dataclass(frozen=True, slots=True)
class Directives:
    """What the request's Cache-Control asks of the cache."""

    no_store: bool = False  # neither read, nor store, nor share an answer
    no_cache: bool = False  # do not serve a stored or running answer; a fresh one may be kept
    max_age: float | None = None  # serve only a stored answer at most this old (seconds)


NONE: Final = Directives()


def directives(headers: Iterable[tuple[str, str]]) -> Directives:
    """Read `Cache-Control` (names are lower case, as the server gives them). `max-age=0`
    means the same as `no-cache`; unknown directives are ignored."""
    no_store = no_cache = False
    max_age: float | None = None
    seen = False
    for name, value in headers:
        if name != "cache-control":
            continue
        seen = True
        for raw in value.split(","):
            word, _, arg = raw.strip().lower().partition("=")
            if word == "no-store":
                no_store = True
            elif word == "no-cache":
                no_cache = True
            elif word == "max-age" and arg.strip().strip('"').isdigit():
                age = float(arg.strip().strip('"'))
                max_age = age if max_age is None else min(max_age, age)
    if not seen:
        return NONE
    if max_age == 0:
        no_cache = True
    return Directives(no_store, no_cache, max_age)


def repeatable(route: str, body: object) -> bool:
    """Is the answer meant to come out the same every time? Sampled routes: temperature 0
    or a seed (OpenAI's `seed`; accepted on any route's body)."""
    if route not in SAMPLING_ROUTES:
        return True
    if not isinstance(body, dict):
        return False
    if body.get("seed") is not None:
        return True
    temperature = body.get("temperature")
    return (
        isinstance(temperature, int | float)
        and not isinstance(temperature, bool)
        and temperature == 0
    )


@dataclass(frozen=True, slots=True)
class Key:
    digest: str  # 64 hex characters
    repeatable: bool


def request_key(
    route: str,
    model: str,
    tenant: str | None,
    body: bytes,
    headers: Iterable[tuple[str, str]] = (),
) -> Key | None:
    """The request's key, or None when its body is not JSON (the handler has read it
    already, so this is for bodies a later route lets through unparsed)."""
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    hasher = hashlib.sha256()
    for part in (route, model, "" if tenant is None else "t:" + tenant):
        hasher.update(part.encode())
        hasher.update(_SEP)
    wanted = dict.fromkeys(KEYED_HEADERS, "")
    for name, value in headers:
        if name in wanted:
            wanted[name] += value + "\n"
    for name in KEYED_HEADERS:
        hasher.update(wanted[name].encode())
        hasher.update(_SEP)
    hasher.update(orjson.dumps(parsed, option=orjson.OPT_SORT_KEYS))
    return Key(hasher.hexdigest(), repeatable(route, parsed))
