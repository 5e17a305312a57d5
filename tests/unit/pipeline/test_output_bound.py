"""The output bound written into the body an engine gets."""

from __future__ import annotations

import msgspec

from hivenet_router.domain.request import Job
from hivenet_router.pipeline.output_bound import with_bound


def job(body: bytes) -> Job:
    return Job("/v1/chat/completions", "m", "llm", False, body, [])


def test_an_undeclared_limit_is_set_and_a_declared_one_only_lowered() -> None:
    unset = with_bound(job(b'{"model": "m", "messages": []}'), 40)
    assert msgspec.json.decode(unset.body) == {"model": "m", "messages": [], "max_tokens": 40}
    assert unset.headers == [("X-Hivenet-Output-Bound", "default")]  # a ceiling, for engines
    both = with_bound(job(b'{"max_tokens": 500, "max_completion_tokens": 30, "n": 2}'), 40)
    assert msgspec.json.decode(both.body) == {
        "max_tokens": 40,
        "max_completion_tokens": 30,
        "n": 2,
    }
    assert both.headers == []  # the client's own limit, lowered
    kept = job(b'{"max_completion_tokens": 30}')
    assert with_bound(kept, 40) is kept  # nothing to change: the original bytes go


def test_a_null_limit_is_absent_and_an_uncounted_one_replaced_by_the_bound() -> None:
    for body in (b'{"max_tokens": null}', b'{"max_completion_tokens": 0}'):
        assert msgspec.json.decode(with_bound(job(body), 7).body)["max_tokens"] == 7
    # A limit the router does not count was held as the policy's default, and the bound
    # replaces it: llama.cpp reads -1 as no limit at all (found by a new user: 993 tokens
    # on a 300-token daily budget).
    for body in (b'{"max_tokens": -1}', b'{"max_tokens": 9.5}', b'{"max_tokens": "9"}'):
        assert msgspec.json.decode(with_bound(job(body), 7).body)["max_tokens"] == 7


def test_llama_cpps_own_limit_is_lowered_with_the_others() -> None:
    """llama.cpp reads `n_predict` before `max_tokens`: left as it came, it carried an
    answer past the bound."""
    for body, expected in (
        (b'{"max_tokens": 10, "n_predict": 400}', {"max_tokens": 7, "n_predict": 7}),
        (b'{"n_predict": 300}', {"max_tokens": 7, "n_predict": 7}),
        (b'{"n_predict": -1}', {"max_tokens": 7, "n_predict": 7}),
        (b'{"max_tokens": 5, "n_predict": 3}', None),  # both within the bound: unchanged
    ):
        kept = job(body)
        bounded = with_bound(kept, 7)
        if expected is None:
            assert bounded is kept
        else:
            assert msgspec.json.decode(bounded.body) == expected, body


def test_a_body_without_any_limit_keeps_its_bytes_after_the_new_field() -> None:
    body = b' {"model": "m",\n "messages": [{"content": "caf\\u00e9"}]} '
    spliced = with_bound(job(body), 12)
    assert (
        spliced.body
        == b' {"max_tokens":12,"model": "m",\n "messages": [{"content": "caf\\u00e9"}]} '
    )
    assert msgspec.json.decode(spliced.body)["max_tokens"] == 12
    assert msgspec.json.decode(with_bound(job(b"{}"), 3).body) == {"max_tokens": 3}
    # The name elsewhere (a tool's parameter) is no limit, but it sends the body the
    # careful way, decoded and encoded again.
    named = b'{"tools": [{"parameters": {"max_tokens": {}}}]}'
    assert msgspec.json.decode(with_bound(job(named), 5).body) == {
        "tools": [{"parameters": {"max_tokens": {}}}],
        "max_tokens": 5,
    }
