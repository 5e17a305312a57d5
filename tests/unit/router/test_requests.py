from __future__ import annotations

import pytest
from aiohttp.test_utils import make_mocked_request
from multidict import CIMultiDict

from hivenet_router.domain.errors import ApiError, ErrorCode
from hivenet_router.router.requests import check_headers, credential, request_id


def _request(*headers: tuple[str, str]) -> object:
    return make_mocked_request("POST", "/v1/chat/completions", headers=CIMultiDict(headers))


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
    ],
)
def test_one_credential(headers: tuple[tuple[str, str], ...], key: str | None) -> None:
    assert credential(_request(*headers)) == key  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "headers",
    [
        (("Authorization", "Bearer k1"), ("Authorization", "Bearer k2")),
        (("Authorization", "Bearer k1"), ("x-api-key", "k2")),
        (("x-api-key", "k1"), ("x-api-key", "k2")),
        (("Authorization", "Basic dXNlcjpwYXNz"), ("x-api-key", "k1")),
    ],
)
def test_conflicting_credentials_are_refused(headers: tuple[tuple[str, str], ...]) -> None:
    with pytest.raises(ApiError) as info:
        credential(_request(*headers))  # type: ignore[arg-type]
    assert info.value.code is ErrorCode.UNAUTHORIZED


def test_headers_are_bounded_in_total() -> None:
    check_headers(_request(("x-a", "v" * 30_000)))  # type: ignore[arg-type]
    with pytest.raises(ApiError) as info:
        check_headers(_request(*((f"x-{i}", "v" * 8000) for i in range(5))))  # type: ignore[arg-type]
    assert info.value.http_status == 431


def test_request_ids() -> None:
    given = "5f3c4a1e-8d2b-4c6e-9a7f-1b2c3d4e5f60"
    assert request_id(given) == given
    made = request_id("not-a-uuid")
    assert made != "not-a-uuid" and len(made) == 36
