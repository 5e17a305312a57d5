"""The output bound a request goes out with.

Admission holds a bounded worst case for every generating request: its input estimate
plus an output bound, the declared limit times `n`, or the policy's `default_max_tokens`
when none is declared, lowered to what the key can still spend. With engines that honour
the request's limit, usage then cannot pass a limit; so the router writes the bound into
the body it forwards (setting the limit, or lowering the declared one) and names it to
the client in `X-Hivenet-Output-Bound` (and, when the router set a limit the request did
not have, to the engine: `X-Hivenet-Output-Bound: default`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Final

import msgspec

from hivenet_router.domain.request import Job
from hivenet_router.pipeline.ticket import Key, Ticket

HEADER: Final = "X-Hivenet-Output-Bound"  # output tokens held for the whole request
# Output tokens held for the whole request (all `n` choices); 0 when none is (the request
# generates nothing, or neither a limit nor a policy default bounds it). Admission sets it,
# the wallet may lower it to what the balance pays for.
OUTPUT_BOUND: Final = Key[int]("output_bound", lambda: 0)
_FIELDS = ("max_tokens", "max_completion_tokens")
# llama.cpp's own name for the limit, which it reads before `max_tokens`: lowered too, so
# that it cannot carry an answer past the bound.
_ALIASES = ("n_predict",)
_NAMES = tuple(b'"%s"' % field.encode() for field in (*_FIELDS, *_ALIASES))
_DECODE = msgspec.json.Decoder(dict[str, Any])


def least_output(bound: int, choices: int, minimum: int) -> int:
    """The least a limit (the output rate, the daily budget, the wallet) may lower `bound`
    to before it refuses instead: one token a choice at least, and the policy's
    `minimum` (min_output_tokens), but never more than the bound itself (a request
    declaring 5 needs no more than 5 where the minimum is 16)."""
    return max(1, choices, min(minimum, bound))


def apply_bound(ticket: Ticket, bound: int) -> None:
    """Hold the request to `bound` output tokens: remembered for later stages, named to the
    client, and written into the body forwarded when it differs from what was declared."""
    facts = ticket.facts
    ticket.put(OUTPUT_BOUND, bound)
    ticket.headers_out[HEADER] = str(bound)
    if (
        ticket.job is not None
        and facts is not None
        and (bound != facts.max_output_tokens or facts.loose_limit)
    ):
        ticket.job = with_bound(ticket.job, max(1, bound // facts.choices))


def with_bound(job: Job, per_choice: int) -> Job:
    """The job with each declared output limit lowered to `per_choice`, or `max_tokens`
    set to it when none is present. The body is rewritten only when something changes."""
    if not any(field in job.body for field in _NAMES):
        # The common case, no limit anywhere in the body: the field goes in first, and the
        # client's bytes follow as they came, with no decoding on the event loop (a large
        # body is decoded by a child process, router/body_reader.py).
        spliced = _splice(job.body, per_choice)
        if spliced is not None:
            return dataclasses.replace(
                job, body=spliced, headers=[*job.headers, (HEADER, "default")]
            )
    try:
        body = _DECODE.decode(job.body)
    except msgspec.DecodeError:
        return job  # bodies.py read it; nothing else to do with one we cannot
    changed = False
    declared = False
    for field in _FIELDS:
        value = body.get(field)
        if value is None or (field == "max_completion_tokens" and value == 0):
            continue  # absent, as the engines read it
        declared = True
        if _past(value, per_choice):
            body[field] = per_choice
            changed = True
    for field in _ALIASES:
        value = body.get(field)
        if value is not None and _past(value, per_choice):
            body[field] = per_choice
            changed = True
    headers = job.headers
    if not declared:
        body["max_tokens"] = per_choice
        changed = True
        # Told to the engine too: a ceiling the router set, not a length the client asked
        # for. Engines ignore it; the simulator then answers at its natural length.
        headers = [*headers, (HEADER, "default")]
    if not changed:
        return job
    return dataclasses.replace(job, body=msgspec.json.encode(body), headers=headers)


def _past(value: Any, per_choice: int) -> bool:
    """Does a limit in the body let more than `per_choice` through? So does a value the
    router counts as undeclared (-1, which llama.cpp reads as no limit, a fraction, a
    string): it was held as the policy's default, and the bound replaces it."""
    return not _whole(value) or value < 0 or value > per_choice


def _whole(value: object) -> bool:
    """A limit the router counted: an integer, or a float without a fraction (64.0)."""
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (isinstance(value, float) and value.is_integer())


def _splice(body: bytes, per_choice: int) -> bytes | None:
    """`max_tokens` as the first member of the body's object (None: no object found)."""
    start = body.find(b"{")
    if start < 0 or body[:start].strip():
        return None
    rest = body[start + 1 :]
    comma = b"" if rest.lstrip().startswith(b"}") else b","
    return body[: start + 1] + b'"max_tokens":%d' % per_choice + comma + rest
