"""The simulator's structured answers validate against the schema they were made for."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, Field

from hivenet_router.sim.schema_answer import instance

NAMES = st.sampled_from(["a", "b", "city", "n", "items", "when", "x_y", "Z"])
PATTERNS = [
    "^[a-z]+$",
    "[0-9]",
    "^A",
    "^[cf]$",
    r"^[A-Z]{3}-\d{2,4}$",
    r"^\d+(\.\d+)?$",
    "^(foo|bar)-(baz)?$",
    r"^[^a-z\s]+$",
    r"^(\w+)@\1\.com$",
]
FORMATS = st.sampled_from(["date-time", "date", "email", "uuid", "uri", "ipv4", "hostname"])


def _valid(schema: dict[str, Any]) -> Any:
    value = instance(schema)
    checker = jsonschema.Draft202012Validator(
        schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
    )
    errors = [e.message for e in checker.iter_errors(value)]
    assert not errors, (schema, value, errors)
    return value


@st.composite
def strings(draw: st.DrawFn) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    if draw(st.booleans()):
        schema["format"] = draw(FORMATS)
        return schema
    least = draw(st.integers(0, 12))
    if draw(st.booleans()):
        schema["minLength"] = least
    if draw(st.booleans()):
        schema["maxLength"] = least + draw(st.integers(0, 5))
    if draw(st.booleans()):
        schema["pattern"] = draw(st.sampled_from(PATTERNS))
        schema.pop("minLength", None)
        schema.pop("maxLength", None)
    return schema


@st.composite
def numbers(draw: st.DrawFn) -> dict[str, Any]:
    kind = draw(st.sampled_from(["integer", "number"]))
    schema: dict[str, Any] = {"type": kind}
    low = draw(st.integers(-50, 50))
    span = draw(st.integers(4, 40))
    step = draw(st.sampled_from([None, 1, 2, 3, 0.5, 0.25, 0.1, 0.01]))
    if step is not None and (kind == "number" or float(step).is_integer()):
        schema["multipleOf"] = step
    if draw(st.booleans()):
        schema["exclusiveMinimum" if draw(st.booleans()) else "minimum"] = low
    if draw(st.booleans()):
        high = low + span
        schema["exclusiveMaximum" if draw(st.booleans()) else "maximum"] = high
    return schema


LEAVES = st.one_of(
    strings(),
    numbers(),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.lists(st.text(max_size=4), min_size=1, max_size=4, unique=True).map(
        lambda values: {"enum": values}
    ),
    st.integers().map(lambda value: {"const": value}),
    st.just({}),
)


def _containers(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[Any]:
    @st.composite
    def objects(draw: st.DrawFn) -> dict[str, Any]:
        props = draw(st.dictionaries(NAMES, children, max_size=4))
        required = [name for name in props if draw(st.booleans())]
        schema: dict[str, Any] = {"type": "object", "properties": props, "required": required}
        if draw(st.booleans()):
            schema["additionalProperties"] = False
        return schema

    @st.composite
    def arrays(draw: st.DrawFn) -> dict[str, Any]:
        least = draw(st.integers(0, 3))
        schema: dict[str, Any] = {"type": "array", "minItems": least}
        if draw(st.booleans()):
            # Unique items of a kind with enough distinct values.
            schema["items"] = draw(st.sampled_from([{"type": "string"}, {"type": "integer"}]))
            schema["uniqueItems"] = True
        else:
            schema["items"] = draw(children)
        if draw(st.booleans()):
            schema["maxItems"] = least + draw(st.integers(0, 2))
        return schema

    nullable = children.map(lambda child: {"anyOf": [child, {"type": "null"}]})
    typed_null = st.sampled_from(["string", "integer", "boolean", "object"]).map(
        lambda kind: {"type": [kind, "null"]}
    )
    merged = st.tuples(objects(), objects()).map(
        lambda pair: {"allOf": [_open(pair[0], ""), _open(pair[1], "_2")]}
    )
    return st.one_of(objects(), arrays(), nullable, typed_null, merged)


def _open(schema: dict[str, Any], suffix: str) -> dict[str, Any]:
    """An object schema for allOf: open to the other part's properties, named apart from
    them (two parts that give one property two types cannot be met)."""
    props = {name + suffix: sub for name, sub in schema["properties"].items()}
    required = [name + suffix for name in schema["required"]]
    return {**schema, "properties": props, "required": required, "additionalProperties": True}


SCHEMAS = st.recursive(LEAVES, _containers, max_leaves=12)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(SCHEMAS)
def test_every_generated_schema_gets_a_valid_instance(schema: dict[str, Any]) -> None:
    _valid(schema)


@settings(max_examples=100, deadline=None)
@given(SCHEMAS)
def test_a_schema_behind_a_ref_is_followed(schema: dict[str, Any]) -> None:
    _valid({"$defs": {"Inner": schema}, "$ref": "#/$defs/Inner"})
    wrapped = {
        "type": "object",
        "properties": {"inner": {"$ref": "#/$defs/Inner"}},
        "required": ["inner"],
        "$defs": {"Inner": schema},
    }
    _valid(wrapped)


def test_the_same_schema_gives_the_same_instance() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    assert instance(schema) == instance(schema) == {"a": "sim"}


def test_a_recursive_schema_ends() -> None:
    tree = {
        "$defs": {
            "Node": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "children": {"type": "array", "items": {"$ref": "#/$defs/Node"}},
                    "parent": {"anyOf": [{"$ref": "#/$defs/Node"}, {"type": "null"}]},
                },
                "required": ["name", "children", "parent"],
            }
        },
        "$ref": "#/$defs/Node",
    }
    value = _valid(tree)
    assert value["name"] == "sim"


class Step(BaseModel):
    explanation: str
    output: str


class Weather(BaseModel):
    city: str
    unit: str = Field(pattern="^[cf]$")
    days: int = Field(ge=1, le=14)
    temperature: float = Field(gt=-90, lt=60)
    steps: list[Step] = Field(min_length=2)
    note: str | None
    tags: set[str]


@pytest.mark.parametrize("model", [Step, Weather])
def test_pydantic_models_accept_the_instance_of_their_schema(model: type[BaseModel]) -> None:
    schema = model.model_json_schema()
    value = _valid(schema)
    model.model_validate(value)


@pytest.mark.parametrize("pattern", PATTERNS)
def test_each_pattern_is_met(pattern: str) -> None:
    _valid({"type": "string", "pattern": pattern})
    _valid({"type": "array", "items": {"type": "string", "pattern": pattern}, "minItems": 2})
