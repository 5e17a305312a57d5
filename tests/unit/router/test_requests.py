from __future__ import annotations

import gzip

import pytest

from hivenet_router.domain.errors import ApiError, ErrorCode
from hivenet_router.http1.messages import Request
from hivenet_router.router.requests import credential, read_body, request_id


def _request(*headers: tuple[str, str], body: bytes = b"") -> Request:
    lowered = [(name.lower(), value) for name, value in headers]
    return Request(None, "POST", "/v1/chat/completions", "", lowered, limit=1000, body=body)


@pytest.mark.parametrize(
    ("headers", "key"),
    [
        ((), None),
        ((("Authorization", "Bearer k1"),), "k1"),
        ((("authorization", "bearer   k1 "),), "k1"),
        ((("x-api-key", "k1"),), "k1"),
        # Claude Code's key helper sends the same key both ways.
        ((("Authorization", "Bearer k1"), ("x-api-key", "k1")), "k1"),
        ((("Authorization", "Bearer k1"), ("Authorization", "Bearer k1")), "k1"),
        ((("Authorization", "Basic dXNlcjpwYXNz"),), None),
        # The reference also takes the bare key, without the scheme.
        ((("Authorization", "sk-hivenet-k1"),), "sk-hivenet-k1"),
        ((("Authorization", " k1 "), ("x-api-key", "k1")), "k1"),
        # An empty header is no key, and does not conflict with one.
        ((("Authorization", "Bearer k1"), ("x-api-key", "")), "k1"),
        ((("Authorization", "Bearer "), ("x-api-key", "k1")), "k1"),
        ((("x-api-key", " "),), None),
    ],
)
def test_one_credential(headers: tuple[tuple[str, str], ...], key: str | None) -> None:
    assert credential(_request(*headers)) == key


@pytest.mark.parametrize(
    "headers",
    [
        (("Authorization", "Bearer k1"), ("Authorization", "Bearer k2")),
        (("Authorization", "Bearer k1"), ("x-api-key", "k2")),
        (("x-api-key", "k1"), ("x-api-key", "k2")),
        (("Authorization", "Basic dXNlcjpwYXNz"), ("x-api-key", "k1")),
        (("Authorization", "k1"), ("x-api-key", "k2")),
    ],
)
def test_conflicting_credentials_are_refused(headers: tuple[tuple[str, str], ...]) -> None:
    with pytest.raises(ApiError) as info:
        credential(_request(*headers))
    assert info.value.code is ErrorCode.UNAUTHORIZED


async def test_bodies_are_decoded_within_the_limit() -> None:
    plain = b'{"model": "m"}'
    assert await read_body(_request(body=plain), 1.0) == plain
    packed = _request(("Content-Encoding", "gzip"), body=gzip.compress(plain))
    assert await read_body(packed, 1.0) == plain
    bomb = _request(("Content-Encoding", "gzip"), body=gzip.compress(b" " * 100_000))
    with pytest.raises(ApiError) as info:
        await read_body(bomb, 1.0)
    # Read to its end: the HTTP server may keep the connection (it decides, not read_body).
    assert info.value.code is ErrorCode.REQUEST_TOO_LARGE and not bomb.close
    for encoding, status in (("br", 415), ("gzip", 400)):
        broken = _request(("Content-Encoding", encoding), body=b"not compressed")
        with pytest.raises(ApiError) as info:
            await read_body(broken, 1.0)
        assert info.value.code is ErrorCode.REQUEST_INVALID
        assert info.value.http_status == status


def test_request_ids() -> None:
    given = "5f3c4a1e-8d2b-4c6e-9a7f-1b2c3d4e5f60"
    assert request_id(given) == given
    made = request_id("not-a-uuid")
    assert made != "not-a-uuid" and len(made) == 36
