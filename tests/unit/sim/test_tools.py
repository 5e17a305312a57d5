from __future__ import annotations

import orjson

from hivenet_router.sim.schema_answer import instance
from hivenet_router.sim.tools import forced_call, pieces, structured

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "unit": {"enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 2},
        "hourly": {"type": ["boolean", "null"]},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 2},
        "where": {"anyOf": [{"type": "object", "properties": {}}, {"type": "null"}]},
        "optional": {"type": "string"},
    },
    "required": ["city", "unit", "days", "hourly", "tags", "where"],
}


def test_examples_satisfy_the_schema_they_came_from() -> None:
    assert instance(SCHEMA) == {
        "city": "sim",
        "unit": "c",
        "days": 2,
        "hourly": True,
        "tags": ["sim", "sim"],
        "where": {},
    }


def test_only_a_forced_choice_calls_a_tool() -> None:
    openai_tools = [{"type": "function", "function": {"name": "f", "parameters": SCHEMA}}]
    anthropic_tools = [{"name": "f", "input_schema": SCHEMA}]
    assert forced_call({"tools": openai_tools}, anthropic=False) is None
    assert forced_call({"tools": openai_tools, "tool_choice": "auto"}, anthropic=False) is None
    call = forced_call({"tools": openai_tools, "tool_choice": "required"}, anthropic=False)
    assert call is not None and call[0] == "f" and orjson.loads(call[1])["days"] == 2
    named = {"type": "function", "function": {"name": "f"}}
    assert forced_call({"tools": openai_tools, "tool_choice": named}, anthropic=False)
    unknown = {"type": "function", "function": {"name": "g"}}
    assert forced_call({"tools": openai_tools, "tool_choice": unknown}, anthropic=False) is None
    assert forced_call({"tools": anthropic_tools, "tool_choice": {"type": "any"}}, anthropic=True)
    tool = {"type": "tool", "name": "f"}
    assert forced_call({"tools": anthropic_tools, "tool_choice": tool}, anthropic=True)
    assert forced_call({"tools": anthropic_tools}, anthropic=True) is None


def test_a_call_asked_for_in_the_users_last_message_counts_past_system_messages() -> None:
    """Claude Code ends its messages with a system one, so `[call:Glob]` in the user's
    last message never called the tool (found by a new user)."""
    tools = [{"name": "Glob", "input_schema": SCHEMA}]
    asked = {"role": "user", "content": [{"type": "text", "text": "List files. [call:Glob]"}]}
    after = {"role": "system", "content": "Be brief."}
    call = forced_call({"tools": tools, "messages": [asked, after]}, anthropic=True)
    assert call is not None and call[0] == "Glob"
    answered = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t"}]}
    assert (
        forced_call({"tools": tools, "messages": [asked, answered, after]}, anthropic=True) is None
    )


def test_structured_answers_and_pieces() -> None:
    shaped = structured(
        {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}
    )
    assert shaped is not None and orjson.loads(shaped)["unit"] == "c"
    echoed = structured(
        {
            "response_format": {"type": "json_object"},
            "messages": [{"role": "user", "content": "say it in JSON"}],
        }
    )
    assert echoed is not None and orjson.loads(echoed) == {
        "answer": "sim",
        "prompt": "say it in JSON",
    }
    anthropic = {"output_format": {"type": "json_schema", "schema": SCHEMA}}
    assert orjson.loads(structured(anthropic) or b"")["days"] == 2
    config = {"output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}}
    assert orjson.loads(structured(config) or b"")["unit"] == "c"
    assert structured({"response_format": {"type": "text"}}) is None
    assert "".join(pieces(b'{"a": "long text here"}', 4)) == '{"a": "long text here"}'
