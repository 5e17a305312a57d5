from __future__ import annotations

import pytest

from hivenet_router.domain.errors import ApiError, ErrorCode
from hivenet_router.router.bodies import MAX_CHOICES, MAX_OUTPUT, parse
from hivenet_router.routing.prefix import PREFIX_CHARS, prompt_blocks


def test_router_validation_follows_the_official_schemas() -> None:
    """The router refuses only what it must interpret and the official schemas refuse too;
    everything else (tools, formats, fields yet to come) is the engine's to judge."""
    chat = parse(
        "/v1/chat/completions",
        b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -1,'
        b' "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto",'
        b' "response_format": {"type": "json_object"}, "stream_options": null}',
    )
    assert chat.max_output_tokens is None  # negative: undeclared
    assert chat.text_bytes == 2 + len(b'[{"type": "function", "function": {"name": "f"}}]')
    assert parse("/v1/completions", b'{"model": "m", "prompt": null}').text_bytes == 0
    assert parse("/v1/messages", b'{"model": "m", "messages": [], "max_tokens": 1}').messages == 0
    agentic = parse(
        "/v1/messages",
        b'{"model": "m", "max_tokens": 5, "system": [{"type": "text", "text": "abc"}],'
        b' "messages": [{"role": "assistant", "content": [{"type": "thinking", "thinking":'
        b' "hmm"}, {"type": "tool_use", "id": "t", "name": "f", "input": {"a": 1}}]},'
        b' {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",'
        b' "content": [{"type": "text", "text": "result"}, {"type": "image", "source": {}}]}]}]}',
    )
    assert agentic.text_bytes == len("abc") + len("hmm") + len('{"a":1}') + len("result")
    assert agentic.images == 1 and agentic.messages == 2


def test_the_prompt_is_read_in_the_order_the_model_reads_it() -> None:
    """Prefix affinity keys on these pieces: chat, completions and Anthropic messages that
    share a system prompt must share a leading piece."""
    chat = parse(
        "/v1/chat/completions",
        b'{"model": "m", "messages": [{"role": "system", "content": "S"},'
        b' {"role": "user", "content": [{"type": "text", "text": "q"},'
        b' {"type": "image_url", "image_url": {"url": "x"}}]}]}',
    )
    assert chat.prompt == ("system", "S", "user", "q")
    anthropic = parse(
        "/v1/messages",
        b'{"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "q"}],'
        b' "system": [{"type": "text", "text": "S"}]}',
    )
    assert anthropic.prompt == ("S", "user", "q")  # the system prompt first, wherever sent
    assert parse("/v1/completions", b'{"model": "m", "prompt": "P"}').prompt == ("P",)
    assert parse("/v1/embeddings", b'{"model": "m", "input": "x"}').prompt == ()


CHAT = "/v1/chat/completions"


@pytest.mark.parametrize(
    "body",
    [
        b'{"model": "m", "messages": [{"role": "user", "content": [{"type": [], "text": "hi"}]}]}',
        b'{"model": "m", "messages": [{"role": "user", "content": [{"type": {"a": 1}}]}]}',
        b'{"model": "m", "messages": [{"role": "assistant", "tool_calls":'
        b' [{"function": {"type": [], "arguments": "{}"}}]}]}',
    ],
)
def test_a_part_whose_type_is_no_string_is_measured_not_a_crash(body: bytes) -> None:
    facts = parse(CHAT, body)
    assert facts.images == 0


def test_a_system_block_whose_type_is_no_string_is_measured() -> None:
    facts = parse("/v1/messages", b'{"model": "m", "max_tokens": 1, "messages": [],'
                  b' "system": [{"type": [1], "text": "abc"}]}')  # fmt: skip
    assert facts.text_bytes == 3


@pytest.mark.parametrize(
    "part",
    [
        b'{"type": "document", "source": {"type": "text", "media_type": "text/plain",'
        b' "data": "' + b"d" * 1000 + b'"}}',
        b'{"type": "file", "file": {"file_data": "' + b"f" * 1000 + b'"}}',
        b'{"type": "input_audio", "input_audio": {"data": "' + b"a" * 1000 + b'"}}',
        b'{"type": "search_result", "source": "s", "title": "t",'
        b' "content": [{"type": "text", "text": "' + b"r" * 1000 + b'"}]}',
    ],
)
def test_parts_without_text_fields_count_by_their_size(part: bytes) -> None:
    body = b'{"model": "m", "messages": [{"role": "user", "content": [' + part + b"]}]}"
    assert parse(CHAT, body).text_bytes >= 1000


def test_names_legacy_functions_documents_and_deep_tool_results_count() -> None:
    body = (
        b'{"model": "m", "messages": [{"role": "user", "name": "' + b"n" * 100 + b'",'
        b' "content": "hi"}], "functions": [{"name": "f", "description": "'
        + b"x" * 500
        + b'"}], "documents": [{"text": "'
        + b"y" * 300
        + b'"}]}'
    )
    assert parse(CHAT, body).text_bytes >= 2 + 100 + 500 + 300
    deep: bytes = b'"' + b"z" * 400 + b'"'
    for _ in range(6):
        deep = b'[{"type": "tool_result", "tool_use_id": "t", "content": ' + deep + b"}]"
    body = b'{"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": '
    assert parse("/v1/messages", body + deep + b"}]}").text_bytes >= 400


def test_token_id_prompts_count_about_a_token_each() -> None:
    one = parse("/v1/completions", b'{"model": "m", "prompt": [1, 2, 3, 4, 5]}')
    batch = parse("/v1/completions", b'{"model": "m", "prompt": [[1, 2, 3], [4, 5]]}')
    assert one.text_bytes == batch.text_bytes == 5 * 4
    # Text and IDs mixed, as llama.cpp reads them, alone and in a batch: the text counts.
    mixed = parse("/v1/completions", b'{"model": "m", "prompt": [1, "' + b"A" * 1000 + b'"]}')
    assert mixed.text_bytes == 4 + 1000
    mixed_batch = parse("/v1/completions", b'{"model": "m", "prompt": [[1, "abc"], [2]]}')
    assert mixed_batch.text_bytes == 4 + 3 + 4


@pytest.mark.parametrize(
    ("fields", "declared"),
    [
        (b'"max_completion_tokens": 0, "max_tokens": 100', 100),
        (b'"max_completion_tokens": 0', None),
        (b'"max_completion_tokens": 7, "max_tokens": 100', 7),
        (b'"max_tokens": 0', 0),
    ],
)
def test_the_output_limit_is_read_as_the_engines_read_it(
    fields: bytes, declared: int | None
) -> None:
    body = b'{"model": "m", "messages": [{"role": "user", "content": "q"}], ' + fields + b"}"
    assert parse(CHAT, body).max_output_tokens == declared


@pytest.mark.parametrize("value", [b"1e308", str(MAX_OUTPUT + 1).encode(), b"9" * 400])
def test_an_absurd_output_limit_is_refused(value: bytes) -> None:
    body = b'{"model": "m", "messages": [{"role": "user", "content": "q"}], "max_tokens": '
    with pytest.raises(ApiError) as info:
        parse(CHAT, body + value + b"}")
    assert info.value.code is ErrorCode.REQUEST_INVALID and "max_tokens" in info.value.message
    assert info.value.param == "max_tokens"


@pytest.mark.parametrize("route", [CHAT, "/v1/completions"])
def test_n_is_bounded_as_openai_bounds_it(route: str) -> None:
    """One request of n = 100,000,000 grew an engine past its memory and took its model
    offline for every client (found by a new user)."""
    head = b'{"model": "m", "messages": [{"role": "user", "content": "q"}], "prompt": "q", '
    assert parse(route, head + b'"n": %d}' % MAX_CHOICES).choices == MAX_CHOICES
    with pytest.raises(ApiError) as info:
        parse(route, head + b'"n": %d}' % (MAX_CHOICES + 1))
    assert info.value.code is ErrorCode.REQUEST_INVALID and info.value.param == "n"
    assert info.value.message == f"n must be at most {MAX_CHOICES}"


def test_bytes_that_are_not_utf8_are_refused_in_any_field() -> None:
    """The decoder checks only the fields it reads: `user` went to the engine as it came
    (found by a new user)."""
    head = b'{"model": "m", "messages": [{"role": "user", "content": "q"}], "user": "'
    with pytest.raises(ApiError) as info:
        parse(CHAT, head + b'\xff\xfe"}')
    assert info.value.code is ErrorCode.REQUEST_INVALID
    assert info.value.message == f"malformed JSON: not UTF-8 at byte {len(head)}"
    assert parse(CHAT, head + "é 中".encode() + b'"}').model == "m"


def _repeat(head: bytes, item: bytes, count: int, tail: bytes) -> bytes:
    return head + b",".join([item] * count) + tail


@pytest.mark.parametrize(
    "body",
    [
        # A hundred thousand short messages, then token IDs alone and in a batch.
        _repeat(
            b'{"model": "m", "messages": [', b'{"role": "user", "content": "ab"}', 100_000, b"]}"
        ),
        _repeat(b'{"model": "m", "prompt": [', b"12345", 100_000, b"]}"),
        _repeat(b'{"model": "m", "prompt": [[', b"12345", 100_000, b"]]}"),
        # Pieces that end exactly where prefix reading stops, separators included.
        _repeat(b'{"model": "m", "prompt": [', b'"' + b"x" * 255 + b'"', 300, b"]}"),
    ],
)
def test_only_the_prompt_that_prefix_routing_reads_is_kept(body: bytes) -> None:
    route = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    facts = parse(route, body)
    kept = sum(len(piece) + 1 for piece in facts.prompt)
    assert PREFIX_CHARS <= kept < PREFIX_CHARS + 300
    # The pieces kept hash exactly as every piece would have.
    everything = facts.prompt + ("more",) * 100
    assert prompt_blocks(facts.prompt) == prompt_blocks(everything)
    assert len(prompt_blocks(facts.prompt)) == PREFIX_CHARS // 256


def test_a_long_token_id_prompt_is_counted_whole() -> None:
    ids = _repeat(b'{"model": "m", "prompt": [', b"7", 200_000, b"]}")
    assert parse("/v1/completions", ids).text_bytes == 200_000 * 4
    text = "\u00e9".encode() * 3  # three two-byte characters
    unicode = b'{"model": "m", "prompt": ["' + text + b'"]}'
    assert parse("/v1/completions", unicode).text_bytes == 6


def test_a_completions_batch_holds_every_prompts_answers() -> None:
    """Each prompt of a batch gets its `n` answers, each up to the limit (found by a new
    user: four prompts were held and charged as one)."""
    cases = {
        b'"prompt": "one"': 1,
        b'"prompt": ["a", "b", "c", "d"]': 4,
        b'"prompt": [[1, 2], [3]]': 2,
        b'"prompt": [1, 2, 3]': 1,  # token IDs: one prompt
        b'"prompt": ["a", 1, "b"]': 1,  # mixed: llama.cpp reads one prompt
        b'"prompt": []': 1,
    }
    for prompt, prompts in cases.items():
        body = b'{"model": "m", %b, "max_tokens": 40, "n": 2}' % prompt
        facts = parse("/v1/completions", body)
        assert facts.choices == 2 * prompts, prompt
        assert facts.max_output_tokens == 40 * 2 * prompts, prompt


def test_llama_cpps_own_limit_counts_as_declared() -> None:
    """llama.cpp reads `n_predict` before `max_tokens`: the request is held at the larger."""
    chat = b'{"model": "m", "messages": [{"role": "user", "content": "x"}], %b}'
    for fields, declared in (
        (b'"max_tokens": 10, "n_predict": 400', 400),
        (b'"n_predict": 300', 300),
        (b'"max_tokens": 10, "n_predict": 3', 10),
        (b'"n_predict": -1', None),
        (b'"n_predict": "many"', None),  # not counted, and not refused either
    ):
        assert parse("/v1/chat/completions", chat % fields).max_output_tokens == declared
