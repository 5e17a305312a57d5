"""The request shapes real clients send, through router and agent to a simulator, with the
official SDKs: tools and tool_choice, a tool call answered and its result sent back, JSON
schema output, images, Anthropic tool_use/tool_result blocks, thinking, cache_control and
system prompts as blocks. The router forwards each body unchanged; the simulator answers a
forced tool call with arguments built from the schema it received, so a right answer shows
the whole request reached the engine.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import orjson
import pytest
from pydantic import BaseModel

from tests.procs import Router, cluster, metric, wait_registered

MODEL = "sim-tools"
PIXEL = base64.b64encode(
    bytes.fromhex(
        "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
        "1f15c4890000000d49444154789c6360000002000100e221bc330000000049454e44ae426082"
    )
).decode()

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1},
            },
            "required": ["city", "unit", "days"],
        },
        "strict": True,
    },
}
ANTHROPIC_WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": WEATHER["function"]["parameters"],  # type: ignore[index]
    "cache_control": {"type": "ephemeral"},
}


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Router]:
    tmp: Path = tmp_path_factory.mktemp("shapes")
    policy = tmp / "policy.yaml"
    policy.write_text("images_max: 1\nrouting_policy: {strategy: least-loaded}\n")
    with cluster(tmp) as c:
        r = c.router("--policy-file", str(policy))
        sim = c.sim(MODEL, "--zero-latency")
        c.agent(r, sim)
        wait_registered(r, MODEL)
        yield r


@pytest.fixture
def oai(router: Router) -> Iterator[openai.OpenAI]:
    with router.openai("unused") as c:
        yield c


@pytest.fixture
def claude(router: Router) -> Iterator[anthropic.Anthropic]:
    with router.anthropic("unused") as c:
        yield c


def test_a_forced_tool_call_and_its_result(oai: openai.OpenAI) -> None:
    messages: list[Any] = [
        {"role": "system", "content": "You answer with tools."},
        {"role": "user", "content": "Weather in Paris for two days?"},
    ]
    first = oai.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], tool_choice="required", max_tokens=50
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls
    assert calls is not None and len(calls) == 1
    call = calls[0]
    assert call.type == "function" and call.function.name == "get_weather"
    assert orjson.loads(call.function.arguments) == {"city": "sim", "unit": "celsius", "days": 1}
    # The assistant's call and the tool's result go back; with tool_choice auto the engine
    # now answers in text.
    messages.append(choice.message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'})
    second = oai.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], tool_choice="auto", max_tokens=8
    )
    assert second.choices[0].message.content
    assert not second.choices[0].message.tool_calls


def test_a_named_tool_streamed(oai: openai.OpenAI) -> None:
    stream = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather?"}],
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False,
        stream=True,
        stream_options={"include_usage": True},
    )
    arguments, names, finish = "", set(), None
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                if delta.function and delta.function.name:
                    names.add(delta.function.name)
                arguments += (delta.function.arguments or "") if delta.function else ""
    assert names == {"get_weather"} and finish == "tool_calls"
    assert orjson.loads(arguments)["city"] == "sim"
    assert usage is not None and usage.completion_tokens > 0


def test_structured_output_from_a_json_schema(oai: openai.OpenAI) -> None:
    class Forecast(BaseModel):
        city: str
        days: int
        sunny: bool

    reply = oai.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "A forecast, as JSON."}],
        response_format=Forecast,
        max_tokens=100,
    )
    parsed = reply.choices[0].message.parsed
    assert parsed == Forecast(city="sim", days=1, sunny=True)


def test_images_in_content_arrays_and_the_image_cap(
    oai: openai.OpenAI, claude: anthropic.Anthropic, router: Router
) -> None:
    image = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PIXEL}"}}
    one: Any = [{"type": "text", "text": "What is this?"}, image]
    reply = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": one}], max_tokens=4
    )
    assert reply.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": [*one, image]}], max_tokens=4
        )
    assert info.value.body["code"] == "input_too_long"  # type: ignore[index]
    block = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": PIXEL},
    }
    message = claude.messages.create(
        model=MODEL,
        max_tokens=4,
        messages=[{"role": "user", "content": [block, {"type": "text", "text": "What?"}]}],  # type: ignore[list-item]
    )
    assert message.content[0].type == "text"
    assert metric(router.metrics(), "hivenet_admission_rejections_total", reason="b1") == 1.0


def test_anthropic_tool_use_and_tool_result_blocks(claude: anthropic.Anthropic) -> None:
    system: Any = [
        {"type": "text", "text": "You are a weather bot.", "cache_control": {"type": "ephemeral"}}
    ]
    messages: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
    first = claude.messages.create(
        model=MODEL,
        max_tokens=64,
        system=system,
        tools=[ANTHROPIC_WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "any"},
        messages=messages,
        metadata={"user_id": "someone"},
    )
    assert first.stop_reason == "tool_use"
    use = first.content[0]
    assert use.type == "tool_use" and use.name == "get_weather"
    assert use.input == {"city": "sim", "unit": "celsius", "days": 1}
    messages.append({"role": "assistant", "content": [use.model_dump(exclude_none=True)]})
    messages.append(
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": use.id,
                    "content": [{"type": "text", "text": "21 degrees"}],
                    "cache_control": {"type": "ephemeral"},
                }
            ],
        }
    )
    second = claude.messages.create(
        model=MODEL,
        max_tokens=16,
        system=system,
        tools=[ANTHROPIC_WEATHER],  # type: ignore[list-item]
        messages=messages,
        thinking={"type": "enabled", "budget_tokens": 1024},
    )
    assert second.stop_reason in ("end_turn", "max_tokens")
    assert second.content[0].type == "text"


def test_anthropic_streamed_tool_use(claude: anthropic.Anthropic) -> None:
    with claude.messages.stream(
        model=MODEL,
        max_tokens=64,
        tools=[ANTHROPIC_WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=[{"role": "user", "content": "Weather?"}],
    ) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert final.content[0].type == "tool_use"
    assert final.content[0].input["unit"] == "celsius"  # type: ignore[index]
    assert final.usage.input_tokens > 0 and final.usage.output_tokens > 0


def test_token_counting_with_tools_and_system_blocks(claude: anthropic.Anthropic) -> None:
    counted = claude.messages.count_tokens(
        model=MODEL,
        system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        tools=[ANTHROPIC_WEATHER],  # type: ignore[list-item]
        messages=[{"role": "user", "content": "Weather?"}],
    )
    assert counted.input_tokens > 0
