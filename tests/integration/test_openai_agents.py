"""openai-agents, the OpenAI Agents SDK, through the router with its default model (the
Responses API) and a function tool: the agent's first turn is forced to call the tool,
the SDK runs it and sends its output back, and the next turn answers in text."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from agents import Agent, ModelSettings, Runner, function_tool, set_tracing_disabled
from agents.models.openai_responses import OpenAIResponsesModel

from tests.integration.test_auth import auth_file, entry
from tests.procs import Router, cluster, metric, wait_until

MODEL = "m"
KEY = "sk-hivenet-agents-sdk-one"


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Router]:
    tmp: Path = tmp_path_factory.mktemp("agents")
    with cluster(tmp) as c:
        served = c.router("--auth-config-file", str(auth_file(tmp, entry(KEY, "acme"))))
        c.agent(served, c.sim(MODEL, "--zero-latency"))
        wait_until(lambda: [m.id for m in served.openai(KEY).models.list()] == [MODEL])
        yield served
        assert "Traceback" not in served.proc.log()


def test_an_agent_calls_its_function_tool_and_answers(router: Router) -> None:
    set_tracing_disabled(True)  # no trace export to OpenAI from a test
    asked: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        asked.append(city)
        return f"Sunny in {city}."

    client = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key=KEY, max_retries=0)
    agent = Agent(
        name="forecaster",
        instructions="Answer with the weather.",
        tools=[get_weather],
        # The SDK's default model class: the Responses API.
        model=OpenAIResponsesModel(model=MODEL, openai_client=client),
        # The simulator calls a tool only when told to; the SDK lifts the requirement after
        # the first call (reset_tool_choice), so the next turn answers in text.
        model_settings=ModelSettings(tool_choice="required"),
    )

    async def run() -> str:
        try:
            result = await Runner.run(agent, "What is the weather in Paris?", max_turns=4)
        finally:
            await client.close()
        return str(result.final_output)

    answer = asyncio.run(run())
    assert len(asked) == 1 and asked[0]  # the tool ran once, with the argument the model gave
    assert answer
    assert metric(router.metrics(), "hivenet_router_active_forwards") == 0.0
