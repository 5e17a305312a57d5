"""The output bound a request goes out with.

Admission holds a bounded worst case for every generating request: its input estimate
plus an output bound, the declared limit times `n`, or the policy's `default_max_tokens`
when none is declared, lowered to what the key can still spend. With engines that honour
the request's limit, usage then cannot pass a limit; so the router writes the bound into
the body it forwards (setting the limit, or lowering the declared one) and names it to
the client in `X-Hivenet-Output-Bound`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Final

import msgspec

from hivenet_router.domain.request import Job

HEADER: Final = "X-Hivenet-Output-Bound"  # output tokens held for the whole request
_FIELDS = ("max_tokens", "max_completion_tokens")
_DECODE = msgspec.json.Decoder(dict[str, Any])


def with_bound(job: Job, per_choice: int) -> Job:
    """The job with each declared output limit lowered to `per_choice`, or `max_tokens`
    set to it when none is declared. The body is rewritten only when something changes."""
    try:
        body = _DECODE.decode(job.body)
    except msgspec.DecodeError:
        return job  # bodies.py read it; nothing else to do with one we cannot
    changed = False
    declared = False
    for field in _FIELDS:
        value = body.get(field)
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            continue
        declared = True
        if value > per_choice:
            body[field] = per_choice
            changed = True
    if not declared:
        body["max_tokens"] = per_choice
        changed = True
    if not changed:
        return job
    return dataclasses.replace(job, body=msgspec.json.encode(body))
