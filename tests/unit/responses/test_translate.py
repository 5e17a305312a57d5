"""A Responses request as chat messages and a chat answer as a Response."""

from __future__ import annotations

import re
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hivenet_router.domain.errors import ApiError, ErrorCode
from hivenet_router.responses import request as request_module
from hivenet_router.responses.request import _ID_BATCH, check_outputs, new_id, parse
from hivenet_router.responses.translate import chat_body, response_from_chat, skeleton


def _chat(body: dict[str, Any], history: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    request = parse(orjson.dumps({"model": "m", **body}))
    chat: dict[str, Any] = orjson.loads(chat_body(request, history or []))
    return chat


def test_items_become_messages_in_order() -> None:
    chat = _chat(
        {
            "instructions": "Be brief.",
            "input": [
                {"role": "developer", "content": "Rules."},
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "What is this?"},
                        {"type": "input_image", "image_url": "data:image/png;base64,AA"},
                    ],
                },
                {"type": "message", "role": "assistant", "content": "Let me look."},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
                {"type": "reasoning", "summary": []},
                {"type": "function_call_output", "call_id": "c1", "output": "one"},
                {
                    "type": "function_call_output",
                    "call_id": "c2",
                    "output": [{"type": "input_text", "text": "two"}],
                },
            ],
        }
    )
    messages = chat["messages"]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "tool"]
    assert messages[0]["content"] == "Be brief.\n\nRules."
    assert messages[1]["content"][1] == {
        "type": "image_url",
        "image_url": {"url": "data:image/png;base64,AA"},
    }
    assert messages[2]["content"] == "Let me look."
    assert [c["id"] for c in messages[2]["tool_calls"]] == ["c1", "c2"]
    assert messages[4] == {"role": "tool", "tool_call_id": "c2", "content": "two"}


def test_options_map_to_their_chat_names() -> None:
    chat = _chat(
        {
            "input": "x",
            "max_output_tokens": 7,
            "temperature": 0.5,
            "top_p": 0.9,
            "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
            "tool_choice": {"type": "function", "name": "f"},
            "parallel_tool_calls": False,
            "text": {"format": {"type": "json_schema", "name": "n", "schema": {}, "strict": True}},
            "reasoning": {"effort": "low"},
            "store": False,
            "metadata": {"a": "b"},
            "include": ["reasoning.encrypted_content"],
            "truncation": "auto",
        }
    )
    assert chat["max_tokens"] == 7 and chat["temperature"] == 0.5 and chat["top_p"] == 0.9
    assert chat["tools"] == [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    ]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert chat["parallel_tool_calls"] is False
    assert chat["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "n", "schema": {}, "strict": True},
    }
    assert chat["reasoning_effort"] == "low"
    for name in ("store", "metadata", "include", "truncation", "input"):
        assert name not in chat


def test_allowed_tools_narrow_the_tools() -> None:
    tools = [{"type": "function", "name": n} for n in ("a", "b")]
    choice = {
        "type": "allowed_tools",
        "mode": "required",
        "tools": [{"type": "function", "name": "b"}],
    }
    chat = _chat({"input": "x", "tools": tools, "tool_choice": choice})
    assert [t["function"]["name"] for t in chat["tools"]] == ["b"]
    assert chat["tool_choice"] == "required"


_FN = {"type": "function", "name": "f"}


def _allowed(mode: str, *names: str) -> dict[str, Any]:
    return {
        "type": "allowed_tools",
        "mode": mode,
        "tools": [{"type": "function", "name": n} for n in names],
    }


def _msg(text: str, item_id: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": text, "id": item_id}


_TWO_SEARCHES = [
    {"type": "namespace", "name": ns, "tools": [{"type": "function", "name": "search"}]}
    for ns in ("gh", "jira")
]


def _choice(name: str, namespace: str) -> dict[str, Any]:
    return {"type": "function", "name": name, "namespace": namespace}


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        (
            {"input": "x", "tools": [{"type": "file_search"}]},
            ErrorCode.UNSUPPORTED_TOOL,
            "tools[0].type",
        ),
        ({"input": "x", "conversation": "c"}, ErrorCode.UNSUPPORTED_PARAMETER, "conversation"),
        ({"input": [{"role": "user", "content": 3}]}, ErrorCode.REQUEST_INVALID, "input[0]"),
        ({"input": "x", "metadata": {"k": 1}}, ErrorCode.REQUEST_INVALID, "metadata"),
        ({"input": "x", "metadata": {"k" * 65: "v"}}, ErrorCode.INVALID_PARAMETER, "metadata"),
        (
            {"input": "x", "tool_choice": {"type": "function", "name": "f"}},
            ErrorCode.INVALID_PARAMETER,
            "tool_choice.name",
        ),
        # Found by a new user: each of these was served as plain text, or refused by the
        # chat body's validation under a field the client never sent.
        (
            {"input": "x", "tools": [_FN], "tool_choice": _allowed("required", "g")},
            ErrorCode.INVALID_PARAMETER,
            "tool_choice.tools[0].name",
        ),
        (
            {"input": "x", "tools": [_FN], "tool_choice": _allowed("required")},
            ErrorCode.INVALID_PARAMETER,
            "tool_choice.tools",
        ),
        ({"input": "x", "tool_choice": "required"}, ErrorCode.INVALID_PARAMETER, "tool_choice"),
        ({"input": "x", "tools": [_FN, _FN]}, ErrorCode.INVALID_PARAMETER, "tools[1].name"),
        ({"input": []}, ErrorCode.INVALID_PARAMETER, "input"),
        (
            {"input": "x", "max_output_tokens": 2**31},
            ErrorCode.INVALID_PARAMETER,
            "max_output_tokens",
        ),
        ({"input": "x", "user": 5}, ErrorCode.REQUEST_INVALID, "user"),
        # Found by a new user (the next eleven): served as they came, or misnamed.
        (
            {"input": [_msg("a", "dup"), _msg("b", "dup")]},
            ErrorCode.INVALID_PARAMETER,
            "input[1].id",
        ),
        ({"input": [{**_msg("a", "x"), "id": 5}]}, ErrorCode.REQUEST_INVALID, "input[0].id"),
        (
            {"input": "x", "tools": _TWO_SEARCHES, "tool_choice": _choice("search", "nope")},
            ErrorCode.INVALID_PARAMETER,
            "tool_choice.namespace",
        ),
        (
            {"input": "x", "tools": [_FN], "tool_choice": {"name": "f"}},
            ErrorCode.REQUEST_INVALID,
            "tool_choice.type",
        ),
        (
            {
                "input": "x",
                "tools": [_FN],
                "tool_choice": {"type": "function", "function": {"name": "f"}},
            },
            ErrorCode.REQUEST_INVALID,
            "tool_choice.name",
        ),
        ({"input": "x", "temperature": 5}, ErrorCode.INVALID_PARAMETER, "temperature"),
        ({"input": "x", "top_p": 2}, ErrorCode.INVALID_PARAMETER, "top_p"),
        ({"input": "x", "top_logprobs": 50}, ErrorCode.INVALID_PARAMETER, "top_logprobs"),
        (
            {"input": "x", "tools": [{**_FN, "strict": "yes"}]},
            ErrorCode.REQUEST_INVALID,
            "tools[0].strict",
        ),
        (
            {"input": "x", "reasoning": {"summary": 5}},
            ErrorCode.REQUEST_INVALID,
            "reasoning.summary",
        ),
        (
            {
                "input": [
                    {
                        "role": "system",
                        "content": [
                            {"type": "input_image", "image_url": "data:image/png;base64,AA"}
                        ],
                    }
                ]
            },
            ErrorCode.INVALID_PARAMETER,
            "input[0].content[0]",
        ),
    ],
)
def test_refusals_name_the_field(body: dict[str, Any], code: ErrorCode, param: str) -> None:
    with pytest.raises(ApiError) as refused:
        parse(orjson.dumps({"model": "m", **body}))
    assert refused.value.code is code and refused.value.param == param


def test_items_without_an_id_get_a_new_one_and_a_call_output_needs_its_call() -> None:
    request = parse(
        orjson.dumps(
            {
                "model": "m",
                "input": [
                    {**_msg("a", "m1"), "id": None},
                    {
                        "type": "function_call",
                        "id": None,
                        "call_id": "c1",
                        "name": "f",
                        "arguments": "{}",
                    },
                    {"type": "function_call_output", "id": "", "call_id": "c1", "output": "ok"},
                ],
            }
        )
    )
    ids = [item["id"] for item in request.items]
    assert all(isinstance(i, str) and i for i in ids) and len(set(ids)) == 3
    check_outputs(request.items, [])  # its call came before it
    output = {"type": "function_call_output", "call_id": "c9", "output": "x"}
    lone = parse(orjson.dumps({"model": "m", "input": [output]}))
    with pytest.raises(ApiError) as refused:
        check_outputs(lone.items, [])
    assert refused.value.param == "input[0].call_id"
    history = [{"type": "function_call", "call_id": "c9", "name": "f", "arguments": "{}"}]
    check_outputs(lone.items, history)  # its call is in the response it continues


def test_a_call_cut_by_the_token_limit_is_incomplete() -> None:
    request = parse(b'{"model": "m", "input": "x", "max_output_tokens": 2}')
    calls = [
        {"id": c, "type": "function", "function": {"name": "f", "arguments": "{}"}}
        for c in ("c1", "c2")
    ]
    chat = {"choices": [{"finish_reason": "length", "message": {"tool_calls": calls}}]}
    response = response_from_chat(skeleton(request, "resp_1"), chat)
    assert [item["status"] for item in response["output"]] == ["completed", "incomplete"]


def test_what_the_client_set_is_echoed() -> None:
    body = {
        "model": "m",
        "input": "x",
        "safety_identifier": "u1",
        "prompt_cache_key": "k",
        "top_logprobs": 2,
        "max_tool_calls": 3,
        "text": {"verbosity": "low"},
        "reasoning": {"summary": "auto"},
    }
    response = skeleton(parse(orjson.dumps(body)), "resp_1")
    for name in ("safety_identifier", "prompt_cache_key", "top_logprobs", "max_tool_calls"):
        assert response[name] == body[name]
    assert response["text"]["verbosity"] == "low"
    assert response["reasoning"]["summary"] == "auto"


def test_a_chat_answer_as_a_response() -> None:
    request = parse(b'{"model": "m", "input": "x", "max_output_tokens": 2}')
    chat = {
        "choices": [
            {
                "finish_reason": "length",
                "message": {
                    "content": "Hi",
                    "reasoning_content": "think",
                    "tool_calls": [
                        {
                            "id": "c",
                            "type": "function",
                            "function": {"name": "f", "arguments": "{}"},
                        }
                    ],
                },
            }
        ],
        "usage": {"prompt_tokens": 5, "completion_tokens": 2},
    }
    response = response_from_chat(skeleton(request, "resp_1"), chat)
    assert [item["type"] for item in response["output"]] == [
        "reasoning",
        "message",
        "function_call",
    ]
    assert response["status"] == "incomplete"
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert response["usage"]["total_tokens"] == 7
    assert response["output"][2]["call_id"] == "c"


def test_integral_floats_are_integers_and_format_names_any_string() -> None:
    """As JSON Schema reads them (the fuzz run found both refused)."""
    fmt = {"type": "json_schema", "name": "", "schema": {}}
    chat = _chat({"input": "x", "max_output_tokens": 64.0, "text": {"format": fmt}})
    assert chat["max_tokens"] == 64 and isinstance(chat["max_tokens"], int)
    with pytest.raises(ApiError):
        parse(b'{"model": "m", "input": "x", "max_output_tokens": 1.5}')


@pytest.mark.parametrize(
    "chat",
    [
        {"choices": "x"},
        {"choices": [3]},
        {"choices": [{"message": [], "finish_reason": []}]},
        {"choices": [{"message": {"tool_calls": [1, {"function": 2}], "content": 5}}]},
        {
            "choices": [],
            "usage": {"prompt_tokens": 1, "completion_tokens": 2, "prompt_tokens_details": [1]},
        },
    ],
)
def test_an_odd_chat_answer_is_still_a_response(chat: dict[str, Any]) -> None:
    request = parse(b'{"model": "m", "input": "x"}')
    response = response_from_chat(skeleton(request, "resp_1"), chat)
    assert response["status"] == "completed"


def test_a_body_that_is_not_json_is_told_where() -> None:
    for body, words in (
        (b'{"model": "m", "input": "caf\xe9"}', "not UTF-8 at byte 28"),
        (b'{"model": "m",\n "input": }', "malformed JSON at line 2 column"),
    ):
        with pytest.raises(ApiError) as refused:
            parse(body)
        assert refused.value.code is ErrorCode.REQUEST_INVALID
        assert words in refused.value.message, refused.value.message


def test_ids_are_random_hex_and_never_repeat() -> None:
    """IDs come from a pool of urandom's bytes (request.new_id): the shape
    `secrets.token_hex(24)` gave, and none twice across refills."""
    made = [new_id("msg") for _ in range(3 * _ID_BATCH + 5)]
    assert all(re.fullmatch(r"msg_[0-9a-f]{48}", made_id) for made_id in made)
    assert len(set(made)) == len(made)


def test_ids_begin_with_their_time_so_the_store_writes_them_side_by_side(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first 12 hex digits are the time in milliseconds, the other 36 random: an ID
    made later sorts after one made earlier (what keeps the store's index writes
    together), and two made in the same millisecond still differ."""
    import hivenet_router.responses.request as request_module

    now = [1_765_000_000_000_000_000]
    monkeypatch.setattr(request_module.time, "time_ns", lambda: now[0])
    first, same = new_id("resp"), new_id("resp")
    now[0] += 1_000_000  # a millisecond later
    later = new_id("resp")
    assert first[5:17] == same[5:17] == f"{1_765_000_000_000:012x}"
    assert first != same and first[17:] != same[17:]
    assert later[5:17] == f"{1_765_000_000_001:012x}"
    assert later > max(first, same)


_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-2, 300),
    st.sampled_from([0.5, 64.0, 1.5, "x", "auto", "disabled", "none", "high", [], {}, ["a"]]),
    st.sampled_from(
        [
            {"effort": "low"},
            {"format": {"type": "json_object"}},
            {"format": {"type": "json_schema", "name": "n", "schema": {}}},
            [{"type": "function", "name": "f"}],
            [{"type": "web_search"}],
            {"type": "function", "name": "f"},
            {"k": "v"},
        ]
    ),
)
_FIELDS = [
    "input", "instructions", "max_output_tokens", "temperature", "top_p", "stream", "store",
    "previous_response_id", "user", "background", "conversation", "prompt",
    "parallel_tool_calls", "truncation", "include", "reasoning", "text", "tools",
    "tool_choice", "metadata",
]  # fmt: skip


def _parsed(body: bytes) -> object:
    ids = iter(range(100))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(request_module, "new_id", lambda prefix: f"{prefix}_{next(ids)}")
        try:
            return parse(body)
        except ApiError as exc:
            return (exc.code, exc.message, exc.param)


@settings(max_examples=500, deadline=None)
@given(st.dictionaries(st.sampled_from(_FIELDS), _VALUES, max_size=3), st.booleans())
def test_a_request_without_the_rare_fields_reads_as_with_every_check(
    fields: dict[str, Any], with_input: bool
) -> None:
    """parse skips the checks of fields that are absent (request._RARE): the same request,
    or the same error, as when every check runs."""
    body = orjson.dumps({"model": "m", **({"input": "x"} if with_input else {}), **fields})
    skipping = _parsed(body)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(request_module, "_RARE", frozenset(["model", "input", *_FIELDS]))
        assert _parsed(body) == skipping


def _namespace(name: str, *functions: str) -> dict[str, Any]:
    tools = [{"type": "function", "name": f, "parameters": {"type": "object"}} for f in functions]
    return {"type": "namespace", "name": name, "tools": tools}


def test_a_namespaces_functions_go_to_the_engine_and_their_calls_come_back_in_it() -> None:
    """Codex sends an MCP server's tools in a namespace and runs a call only by it: a call
    that came back without its namespace was "unsupported call: search", and two servers'
    `search` were refused (found by a new user). The engine, which knows no namespaces,
    gets a shared name qualified."""
    body = {
        "input": "x",
        "tools": [
            _namespace("mcp__docs", "search", "fetch"),
            _namespace("mcp__code", "search"),
            {"type": "function", "name": "shell"},
        ],
    }
    chat = _chat(body)
    sent = [tool["function"]["name"] for tool in chat["tools"]]
    assert sent == ["mcp__docs__search", "fetch", "mcp__code__search", "shell"]
    request = parse(orjson.dumps({"model": "m", **body}))
    calls = [
        {"id": f"c{n}", "type": "function", "function": {"name": name, "arguments": "{}"}}
        for n, name in enumerate(["mcp__code__search", "fetch", "shell"])
    ]
    answer = {"choices": [{"finish_reason": "tool_calls", "message": {"tool_calls": calls}}]}
    output = response_from_chat(skeleton(request, "resp_1"), answer)["output"]
    named = [(item.get("namespace"), item["name"]) for item in output]
    assert named == [("mcp__code", "search"), ("mcp__docs", "fetch"), (None, "shell")]
    # The call and its output sent back (as Codex does): the engine sees its own names.
    history = [
        {
            "type": "function_call",
            "call_id": "c0",
            "namespace": "mcp__code",
            "name": "search",
            "arguments": "{}",
        },
        {"type": "function_call_output", "call_id": "c0", "output": "found"},
    ]
    again = _chat({**body, "input": history})
    assert again["messages"][0]["tool_calls"][0]["function"]["name"] == "mcp__code__search"
    # tool_choice may name a namespace's function.
    choice = {"type": "function", "name": "search", "namespace": "mcp__code"}
    forced = _chat({**body, "tool_choice": choice})
    assert forced["tool_choice"] == {"type": "function", "function": {"name": "mcp__code__search"}}


def test_one_namespace_naming_a_function_twice_is_refused() -> None:
    with pytest.raises(ApiError, match="another function tool has this name"):
        _chat({"input": "x", "tools": [_namespace("mcp__docs", "search", "search")]})
