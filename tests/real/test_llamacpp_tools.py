"""Tools, structured output and the other shapes real clients send, through router and
agent to a real llama.cpp server that parses tool calls (--jinja with a template that
renders tools and tool calls). The model is tiny and its words are gibberish: whether it
calls the tool is up to it (llama.cpp lets content come first), but every answer must be
well formed, every call it makes must name a declared tool with JSON arguments, and a
JSON-schema answer (grammar-constrained from the first token) must parse.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import orjson
import pytest

from tests.procs import Router, cluster, metric, wait_registered
from tests.real.engines import CHAT_MODEL, Artefacts, llama_server

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
        },
    },
}
PROMPT = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory, real: Artefacts) -> Iterator[Router]:
    tmp: Path = tmp_path_factory.mktemp("llama-tools")
    with cluster(tmp) as c:
        r = c.router()
        engine = llama_server(c, real, "llama-tools", slots=1, tools=True)
        c.agent(r, None, "--engine", "llama-cpp", backend_url=engine.url)
        wait_registered(r, CHAT_MODEL, timeout=30)
        yield r


@pytest.fixture
def oai(router: Router) -> Iterator[openai.OpenAI]:
    with router.openai() as client:
        yield client


@pytest.fixture
def claude(router: Router) -> Iterator[anthropic.Anthropic]:
    with router.anthropic() as client:
        yield client


def _calls_are_well_formed(calls: list[Any] | None, finish_reason: str) -> str:
    """The arguments of the first call (or "{}" when the model made none). A small model
    may run out of tokens inside the arguments: then they are not JSON, and a stand-in
    is sent back instead."""
    for call in calls or []:
        assert call.function.name == "get_weather"
        if finish_reason != "length":
            assert isinstance(orjson.loads(call.function.arguments), dict)
    if not calls or finish_reason == "length":
        return '{"city": "Paris"}' if calls else "{}"
    return str(calls[0].function.arguments)


def test_tools_and_a_tool_result_sent_back(oai: openai.OpenAI) -> None:
    first = oai.chat.completions.create(
        model=CHAT_MODEL,
        messages=PROMPT,  # type: ignore[arg-type]
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=80,
        temperature=0,
    )
    reason = first.choices[0].finish_reason
    assert reason in ("tool_calls", "length", "stop")
    arguments = _calls_are_well_formed(first.choices[0].message.tool_calls, reason)
    messages: list[Any] = [
        *PROMPT,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees and sunny"},
    ]
    second = oai.chat.completions.create(
        model=CHAT_MODEL,
        messages=messages,
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="auto",
        max_tokens=6,
    )
    # The engine rendered the call and its result into the prompt.
    assert second.usage is not None and first.usage is not None
    assert second.usage.prompt_tokens > first.usage.prompt_tokens


def test_tools_streamed(oai: openai.OpenAI) -> None:
    stream = oai.chat.completions.create(
        model=CHAT_MODEL,
        messages=PROMPT,  # type: ignore[arg-type]
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="required",
        max_tokens=40,
        stream=True,
        stream_options={"include_usage": True},
    )
    names: set[str] = set()
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                if delta.function and delta.function.name:
                    names.add(delta.function.name)
    assert names <= {"get_weather"}
    assert usage is not None and usage.completion_tokens > 0


def test_json_schema_output(oai: openai.OpenAI) -> None:
    reply = oai.chat.completions.create(
        model=CHAT_MODEL,
        messages=[{"role": "user", "content": "A city, as JSON."}],
        # The grammar lets the small model put whitespace (newlines, indentation) between
        # the tokens; 40 tokens were sometimes spent before the closing brace.
        max_tokens=256,
        response_format={
            "type": "json_schema",
            "json_schema": {
                "name": "place",
                "schema": {
                    "type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 12}},
                    "required": ["city"],
                },
            },
        },
    )
    content = reply.choices[0].message.content
    assert content is not None
    assert isinstance(orjson.loads(content)["city"], str)


def test_anthropic_tools_blocks_and_system_blocks(claude: anthropic.Anthropic) -> None:
    tool = {
        "name": "get_weather",
        "input_schema": WEATHER["function"]["parameters"],  # type: ignore[index]
        "cache_control": {"type": "ephemeral"},
    }
    message = claude.messages.create(
        model=CHAT_MODEL,
        max_tokens=16,
        system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        tools=[tool],  # type: ignore[list-item]
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": [
                    {
                        "type": "tool_use",
                        "id": "toolu_01",
                        "name": "get_weather",
                        "input": {"city": "Paris"},
                    }
                ],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "toolu_01", "content": "21C"}],
            },
        ],
    )
    assert message.usage.input_tokens > 0 and message.usage.output_tokens > 0
    with claude.messages.stream(
        model=CHAT_MODEL,
        max_tokens=8,
        tools=[tool],  # type: ignore[list-item]
        messages=[{"role": "user", "content": "Weather?"}],
    ) as stream:
        final = stream.get_final_message()
    assert final.usage.output_tokens > 0


def test_a_prompt_over_the_engine_context_is_the_clients_error(
    oai: openai.OpenAI, router: Router
) -> None:
    """llama.cpp refuses a prompt longer than its context with a 400: passed back as the
    engine said it, never retried elsewhere, and not counted against the agent."""
    for _ in range(4):
        with pytest.raises(openai.BadRequestError) as info:
            oai.chat.completions.create(
                model=CHAT_MODEL,
                messages=[{"role": "user", "content": "word " * 3000}],
                max_tokens=4,
            )
        body = info.value.body
        assert body["source"] == "backend" and body["code"] == "context_length_exceeded"  # type: ignore[index]
    assert metric(router.metrics(), "hivenet_agent_requests_failed_total") == 0.0
    reply = oai.chat.completions.create(model=CHAT_MODEL, messages=PROMPT, max_tokens=3)  # type: ignore[arg-type]
    assert reply.usage is not None and reply.usage.completion_tokens > 0
