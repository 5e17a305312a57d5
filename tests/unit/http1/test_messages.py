"""The request and answer objects of the public HTTP/1.1 server, without a socket."""

from __future__ import annotations

import gzip
import zlib

import pytest

from hivenet_router.http1.connection import _split_target
from hivenet_router.http1.messages import (
    BodyError,
    BodyTooLarge,
    EncodingUnsupported,
    Headers,
    Request,
    decode,
    head,
)


def test_bodies_decode_within_their_bound() -> None:
    text = b'{"model": "m"}' * 10
    assert decode(gzip.compress(text), "gzip", 1000) == text
    assert decode(zlib.compress(text), "Deflate", 1000) == text
    raw = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    assert decode(raw.compress(text) + raw.flush(), "deflate", 1000) == text
    assert decode(text, "identity", 10) == text
    with pytest.raises(BodyTooLarge):
        decode(gzip.compress(b"x" * 10_000), "gzip", 1000)  # a bomb stops at the bound
    with pytest.raises(BodyError):
        decode(b"not gzip at all", "gzip", 1000)
    with pytest.raises(BodyError):
        decode(gzip.compress(text)[:-12], "gzip", 1000)  # cut short
    with pytest.raises(EncodingUnsupported):
        decode(text, "br", 1000)


def test_a_head_leaves_out_values_that_would_break_it() -> None:
    out = head(404, {"X-Ok": "1", "X-Bad": "a\r\nSet-Cookie: x"}, 3, close=True)
    assert out.startswith(b"HTTP/1.1 404 Not Found\r\n") and out.endswith(b"\r\n\r\n")
    assert b"X-Ok: 1\r\n" in out and b"Set-Cookie" not in out and b"X-Bad" not in out
    assert b"Content-Length: 3\r\n" in out and b"Connection: close\r\n" in out
    assert b"\r\nDate: " in out


async def test_a_request_reads_headers_query_and_an_encoded_body() -> None:
    request = Request(
        None,
        "POST",
        "/v1/x",
        "a=1&a=2&b=",
        [("content-encoding", "gzip"), ("x-key", "one"), ("x-key", "two")],
        body=gzip.compress(b"hello"),
    )
    assert request.headers["X-Key"] == "one" and request.headers.getall("x-key") == ["one", "two"]
    assert "CONTENT-ENCODING" in request.headers and request.headers.get("missing") is None
    assert request.query == {"a": "1", "b": ""}
    assert await request.read() == b"hello"


def test_headers_give_the_first_value_and_see_what_joins_later() -> None:
    items = [("x-a", "1"), ("x-b", "2"), ("x-a", "3")]
    headers = Headers(items)
    assert headers.get("X-A") == "1" and headers["x-b"] == "2" and "X-B" in headers
    assert headers.getall("x-a") == ["1", "3"]
    assert headers.get("x-c") is None and "x-c" not in headers
    items.append(("x-c", "4"))  # a trailer of a chunked body, after the first lookup
    headers.reindex()
    assert headers.get("x-c") == "4" and headers.get("x-a") == "1"


def test_a_path_is_decoded_but_an_encoded_slash_or_percent_sign_stays() -> None:
    """A route's parameter is decoded after the route matched (router/edge.py): a slash
    in it must not split the path, nor a percent sign be decoded twice."""
    assert _split_target(b"/admin/wallets/team%2fa/credit?x=%2F") == (
        "/admin/wallets/team%2Fa/credit",
        "x=%2F",
    )
    assert _split_target(b"/v1/chat%2Dcompletions") == ("/v1/chat-completions", "")
    assert _split_target(b"/a/50%25off/%C3%A9") == ("/a/50%25off/\u00e9", "")
