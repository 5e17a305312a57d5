"""Reading a client's request safely: its ID, its credential, its headers and its body.

Every way these can be wrong is the client's error, answered with a stable code; none of
them reaches an agent.
"""

from __future__ import annotations

import asyncio
import random
import uuid

from hivenet_router.domain.errors import ApiError, ErrorCode
from hivenet_router.http1.messages import BodyError, BodyTooLarge, Request

# The request line and all headers together (the server answers 431 past it). Headers
# travel to the agent in one frame, so they must stay well under its 64 KiB.
MAX_HEADER_BYTES = 32 * 1024


_VERSION_4 = (0x4000 << 64) | (0x8000 << 48)  # the version nibble and the RFC 4122 variant
_CLEAR = ~((0xF000 << 64) | (0xC000 << 48))


def request_id(supplied: str | None) -> str:
    """Keep a client's X-Request-ID only when it is a UUID; otherwise make one.

    Request IDs correlate logs; they are not secrets, so a fast pseudo-random version-4
    UUID will do (uuid4 costs a system call per request, and uuid.UUID an object).
    """
    if supplied:
        try:
            return str(uuid.UUID(supplied))
        except ValueError:
            pass
    h = "%032x" % ((random.getrandbits(128) & _CLEAR) | _VERSION_4)
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def credential(request: Request) -> str | None:
    """The presented key: `Authorization: Bearer KEY`, a bare `Authorization: KEY` (as the
    reference accepts), or `x-api-key` (what the Anthropic SDK sends; the Go router
    accepted only the first two). Both headers may carry the same key, as Claude Code's
    key helper sends it; two different keys, in repeated headers or across the two, are
    refused rather than resolved by picking one. Another scheme (`Basic ...`) is no key."""
    headers = request.headers
    found: set[str] = set()
    for value in headers.getall("authorization"):
        text = value.strip()
        scheme, space, rest = text.partition(" ")
        if scheme.lower() == "bearer":
            key = rest.strip()
        elif space:
            key = "\0" + text  # another scheme: no key of ours, but it conflicts with one
        else:
            key = text
        if key:
            found.add(key)
    # An empty header carries no key: it neither conflicts with another nor is one.
    found.update(value for value in headers.getall("x-api-key") if value.strip())
    if len(found) > 1:
        raise ApiError(
            ErrorCode.UNAUTHORIZED,
            "conflicting credentials: send one key, as Authorization: Bearer or x-api-key",
        )
    presented = next(iter(found), None)
    return None if presented is None or presented.startswith("\0") else presented


async def read_body(request: Request, timeout: float) -> bytes:
    """The whole request body, decoded as its Content-Encoding says, within `timeout`.

    Every way a body can be bad is the client's error with a stable code: too large (413),
    too slow (408), undecodable or cut short (400), in an encoding not offered (415). The
    connection is then closed, since the rest of the body cannot be trusted to be skipped;
    except after a 413 for a body that was read to its end, which the HTTP server keeps."""
    try:
        if request.complete:
            # Already all here (the common case for a small body): no timer needed.
            return await request.read()
        async with asyncio.timeout(timeout):
            return await request.read()
    except BodyTooLarge as exc:
        raise ApiError(ErrorCode.REQUEST_TOO_LARGE, str(exc)) from None
    except TimeoutError:
        request.close = True
        raise ApiError(
            ErrorCode.REQUEST_TIMEOUT, f"request body not received within {timeout:g}s", status=408
        ) from None
    except BodyError as exc:
        request.close = True
        raise ApiError(ErrorCode.REQUEST_INVALID, str(exc), status=exc.status) from None
