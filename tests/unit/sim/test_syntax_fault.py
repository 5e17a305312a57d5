"""The simulator's syntax fault: JSON answers (structured output, forced tool calls) come
back broken so that no continuation could fix them; text answers are left alone."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from hivenet_router.config.sim import SimConfig
from hivenet_router.gateway.jsonprefix import JsonPrefix
from hivenet_router.sim.faults import BREAK, break_json
from hivenet_router.sim.server import Simulator
from tests.unit.sim.test_server import HI, Client, serve

TOOL = {
    "type": "function",
    "function": {
        "name": "f",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


@pytest.fixture
async def broken() -> AsyncIterator[Client]:
    client = await serve(Simulator(SimConfig(zero_latency=True, fault_syntax_rate=1.0)))
    try:
        yield client
    finally:
        await client.close()


def first_bad(text: str) -> int | None:
    checker = JsonPrefix()
    checker.feed(text)
    return checker.error


async def test_json_answers_and_tool_arguments_break(broken: Client) -> None:
    body = {"model": "sim-model", "messages": HI, "response_format": {"type": "json_object"}}
    reply = await (await broken.post("/v1/chat/completions", json=body)).json()
    content = reply["choices"][0]["message"]["content"]
    # In a string the escape letter is the first bad character, outside one the backslash.
    assert BREAK in content and first_bad(content) in (
        content.index(BREAK),
        content.index(BREAK) + 1,
    )
    body = {"model": "sim-model", "messages": HI, "tools": [TOOL], "tool_choice": "required"}
    reply = await (await broken.post("/v1/chat/completions", json=body)).json()
    arguments = reply["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
    assert first_bad(arguments) is not None
    text = await (
        await broken.post("/v1/chat/completions", json={"model": "sim-model", "messages": HI})
    ).json()
    assert BREAK not in text["choices"][0]["message"]["content"]


async def test_the_rate_is_an_admin_fault(broken: Client) -> None:
    assert (await (await broken.get("/admin/faults")).json())["syntax_rate"] == 1.0
    assert (await broken.post("/admin/faults", json={"syntax_rate": 0})).status == 200
    body = {"model": "sim-model", "messages": HI, "response_format": {"type": "json_object"}}
    reply = await (await broken.post("/v1/chat/completions", json=body)).json()
    content = reply["choices"][0]["message"]["content"]
    assert first_bad(content) is None


def test_the_break_is_never_an_escaped_backslash() -> None:
    assert break_json(['{"a": "x\\\\', '"}']) == ['{"a": "x\\\\', '"}' + BREAK]
    assert break_json([]) == []
