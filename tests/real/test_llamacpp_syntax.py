"""The validator's syntax judging over a real llama.cpp's structured output: JSON-schema and
JSON-object answers (grammar-constrained) and tool calls, streamed and whole, through
router and agent with `stream_validator` on (its loop checks off, so only syntax is judged)
and no other agent or provider to replace an answer with.

The count that matters is false positives: answers the judge calls broken that an
independent reading (json.loads and jsonschema) finds sound. The target is none, and every
answer must reach the client (a rejected one would be a 502 `malformed_output`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from tests.procs import Router, cluster, metric, wait_registered
from tests.real.engines import CHAT_MODEL, Artefacts, llama_server

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 16},
        "days": {"type": "integer"},
        "sunny": {"type": "boolean"},
    },
    "required": ["city", "days", "sunny"],
    "additionalProperties": False,
}
TOOL = {"type": "function", "function": {"name": "plan_trip", "parameters": SCHEMA}}
POLICY = f"""\
models: [{CHAT_MODEL}]
routing_policy: {{strategy: least-loaded, max_tries: 1}}
circuit_breaker: {{enabled: false}}
stream_validator:
  max_repeat_fraction: 1
  min_compression_ratio: 0
  max_same_chunk: 100000
"""
PROMPTS = ["Plan a trip to Paris.", "A long trip to Rome, please.", "Three days in Oslo?"]


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory, real: Artefacts) -> Iterator[Router]:
    tmp: Path = tmp_path_factory.mktemp("llama-syntax")
    policies = tmp / "policies"
    policies.mkdir()
    (policies / "m.yaml").write_text(POLICY)
    with cluster(tmp) as c:
        r = c.router("--policy-model-dir", str(policies))
        engine = llama_server(c, real, "llama-syntax", slots=1, tools=True)
        c.agent(r, None, "--engine", "llama-cpp", backend_url=engine.url)
        wait_registered(r, CHAT_MODEL, timeout=30)
        yield r


def sound(text: str, finish: str | None) -> bool:
    """The independent reading: a whole answer parses and fits; one cut by its token limit
    is no fault of the model's syntax."""
    if finish == "length":
        return True
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def ask(client: openai.OpenAI, prompt: str, stream: bool, **shape: Any) -> tuple[str, str | None]:
    """The answer's JSON text (content, or the first tool call's arguments) and its finish."""
    request: dict[str, Any] = {
        "model": CHAT_MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 80,
        "temperature": 0.7,
        **shape,
    }
    if not stream:
        reply = client.chat.completions.create(**request)
        choice = reply.choices[0]
        calls = choice.message.tool_calls
        text = calls[0].function.arguments if calls else choice.message.content  # type: ignore[union-attr]
        return text or "", choice.finish_reason
    text, finish = "", None
    for chunk in client.chat.completions.create(**request, stream=True):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                text += (call.function.arguments or "") if call.function else ""
            finish = choice.finish_reason or finish
    return text, finish


@pytest.mark.timeout(600)  # a dozen answers from a CPU engine on a shared machine
def test_real_structured_output_has_no_false_positives(router: Router) -> None:
    shapes: dict[str, dict[str, Any]] = {
        "json_schema": {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "t", "schema": SCHEMA},
            }
        },
        "tools": {"tools": [TOOL], "tool_choice": "required"},
    }
    answers, unsound = 0, []
    with router.openai() as client:
        for name, shape in shapes.items():
            for prompt in PROMPTS:
                for stream in (True, False):
                    started = time.monotonic()
                    text, finish = ask(client, prompt, stream, **shape)  # a 502 would raise
                    print(name, stream, finish, f"{time.monotonic() - started:.1f}s", repr(text))
                    answers += 1
                    if not sound(text, finish):
                        unsound.append((name, stream, finish, text))
    page = router.metrics()
    judged = {
        r: metric(page, "hivenet_validator_streams_total", result=r)
        for r in ("clean", "syntax", "late_syntax")
    }
    # Every answer was judged, none was called broken; and the independent reading agrees
    # (an answer it found unsound would have been a miss, not a false positive).
    assert judged == {"clean": answers, "syntax": 0, "late_syntax": 0}, (judged, unsound)
    assert unsound == [], unsound


@pytest.mark.timeout(300)
def test_real_anthropic_tool_use_has_no_false_positives(router: Router) -> None:
    """The Messages route's events (llama.cpp's own /v1/messages), with tools offered."""
    tool = {"name": "plan_trip", "input_schema": SCHEMA}
    before = metric(router.metrics(), "hivenet_validator_streams_total", result="clean") or 0.0
    with router.anthropic() as client:
        for prompt in PROMPTS[:2]:
            with client.messages.stream(
                model=CHAT_MODEL,
                max_tokens=80,
                messages=[{"role": "user", "content": prompt}],
                tools=[tool],  # type: ignore[list-item]
                tool_choice={"type": "any"},
            ) as stream:
                message = stream.get_final_message()  # a 502 would raise
            print("anthropic", message.stop_reason, message.content)
    page = router.metrics()
    assert metric(page, "hivenet_validator_streams_total", result="clean") == before + 2
    for result in ("syntax", "late_syntax"):
        assert metric(page, "hivenet_validator_streams_total", result=result) == 0.0
