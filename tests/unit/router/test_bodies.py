from __future__ import annotations

from hivenet_router.router.bodies import parse


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
