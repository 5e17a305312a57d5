from __future__ import annotations

import pytest

from hivenet_router.domain.errors import ApiError, ErrorCode
from hivenet_router.http1.messages import Request
from hivenet_router.router.handlers import MAX_FORWARDED_HEADERS, forward_headers


def _request(headers: list[tuple[str, str]]) -> Request:
    return Request(None, "POST", "/v1/chat/completions", "", headers, body=b"{}")


def test_forwarded_headers_leave_out_hop_by_hop_and_credentials() -> None:
    request = _request(
        [("host", "r"), ("authorization", "Bearer k"), ("x-request-id", "x"), ("x-a", "1")]
    )
    assert forward_headers(request, "rid") == [("x-a", "1"), ("x-request-id", "rid")]


def test_as_many_headers_as_an_engine_takes_are_forwarded() -> None:
    # The request's own ID is one of them; what is never forwarded does not count.
    mine = [(f"x-h{n}", "v") for n in range(MAX_FORWARDED_HEADERS - 1)]
    dropped = [("host", "r"), ("content-length", "2"), ("authorization", "Bearer k")]
    assert len(forward_headers(_request(dropped + mine), "rid")) == MAX_FORWARDED_HEADERS


def test_more_headers_than_an_engine_takes_are_the_clients_error() -> None:
    mine = [(f"x-h{n}", "v") for n in range(MAX_FORWARDED_HEADERS)]
    with pytest.raises(ApiError) as raised:
        forward_headers(_request(mine), "rid")
    assert raised.value.code is ErrorCode.REQUEST_TOO_LARGE
    assert raised.value.http_status == 431
    assert f"at most {MAX_FORWARDED_HEADERS}" in raised.value.message
