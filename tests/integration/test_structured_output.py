"""Structured output and forced tool calls through router and agent to the simulator: the
official SDKs' own parsers accept what comes back."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import jsonschema
import openai
import orjson
import pytest
from pydantic import BaseModel, Field

from tests.procs import Router, cluster, wait_registered

MODEL = "sim-chat"


class Step(BaseModel):
    explanation: str
    output: str


class Itinerary(BaseModel):
    city: str
    days: int = Field(ge=2, le=10)
    budget: float = Field(gt=100, lt=5000)
    mode: Literal["train", "plane", "car"]
    code: str = Field(pattern=r"^[A-Z]{3}-\d{2}$")
    steps: list[Step] = Field(min_length=2)
    note: str | None
    tags: list[str]


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Router]:
    tmp: Path = tmp_path_factory.mktemp("structured")
    with cluster(tmp) as c:
        router = c.router()
        c.agent(router, c.sim(MODEL, "--zero-latency"))
        wait_registered(router, MODEL)
        yield router


def test_openai_parse_gets_a_valid_object(router: Router) -> None:
    with router.openai() as client:
        reply = client.chat.completions.parse(
            model=MODEL,
            messages=[{"role": "user", "content": "Plan a trip, as JSON."}],
            response_format=Itinerary,
            max_tokens=400,
        )
    parsed = reply.choices[0].message.parsed
    assert isinstance(parsed, Itinerary)
    assert len(parsed.steps) >= 2 and 2 <= parsed.days <= 10 and parsed.mode == "train"


def test_openai_json_object_echoes_the_prompt(router: Router) -> None:
    with router.openai() as client:
        reply = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "name three rivers"}],
            response_format={"type": "json_object"},
            max_tokens=50,
        )
    answer = orjson.loads(reply.choices[0].message.content or "")
    assert isinstance(answer, dict) and answer["prompt"] == "name three rivers"


def test_openai_forced_tool_call_arguments_fit_the_parameters(router: Router) -> None:
    tool = openai.pydantic_function_tool(Itinerary, name="plan")
    with router.openai() as client:
        reply = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Plan it."}],
            tools=[tool],
            tool_choice={"type": "function", "function": {"name": "plan"}},
            max_tokens=400,
        )
    calls = reply.choices[0].message.tool_calls
    assert calls and calls[0].type == "function"
    Itinerary.model_validate_json(calls[0].function.arguments)


def test_anthropic_forced_tool_use_input_is_valid(router: Router) -> None:
    schema: dict[str, Any] = Itinerary.model_json_schema()
    with router.anthropic() as client:
        message = client.messages.create(
            model=MODEL,
            max_tokens=400,
            tools=[{"name": "plan", "description": "A trip plan", "input_schema": schema}],
            tool_choice={"type": "tool", "name": "plan"},
            messages=[{"role": "user", "content": "Plan it."}],
        )
    assert message.stop_reason == "tool_use"
    use = message.content[0]
    assert use.type == "tool_use" and use.name == "plan"
    jsonschema.validate(use.input, schema)
    Itinerary.model_validate(use.input)


class Plan(BaseModel):
    """What Anthropic's structured output carries: its SDK moves numeric and length bounds
    out of the schema it sends (into descriptions), so they are not asked for here."""

    city: str
    mode: Literal["train", "plane", "car"]
    steps: list[Step]
    note: str | None


def test_anthropic_structured_output_parses(router: Router) -> None:
    with router.anthropic() as client:
        message = client.messages.parse(
            model=MODEL,
            max_tokens=400,
            messages=[{"role": "user", "content": "Plan a trip."}],
            output_format=Plan,
        )
    assert isinstance(message.parsed_output, Plan)
    assert message.parsed_output.steps and message.parsed_output.mode == "train"


def test_a_streamed_structured_answer_joins_into_valid_json(router: Router) -> None:
    with router.openai() as client:
        stream = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Plan a trip, as JSON."}],
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "itinerary", "schema": Itinerary.model_json_schema()},
            },
            max_tokens=400,
            stream=True,
        )
        text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    Itinerary.model_validate_json(text)
