"""The schema checker against the `jsonschema` package (a development dependency) on the
subset it reads: both agree on every generated schema and value."""

from __future__ import annotations

from typing import Any

import jsonschema
from hypothesis import given, settings
from hypothesis import strategies as st

from hivenet_router.gateway.schema_subset import violation

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-3, 3)
    | st.sampled_from([0.5, 1.0])
    | st.sampled_from(["a", "b"])
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from("abc"), inner, max_size=3)
    ),
    max_leaves=8,
)
TYPES = ["string", "integer", "number", "boolean", "null", "object", "array"]


def schemas() -> st.SearchStrategy[dict[str, Any]]:
    leaf = st.fixed_dictionaries(
        {},
        optional={
            "type": st.sampled_from(TYPES)
            | st.lists(st.sampled_from(TYPES), min_size=1, max_size=2),
            "enum": st.lists(scalars, min_size=1, max_size=3),
        },
    )
    return st.recursive(
        leaf,
        lambda inner: st.fixed_dictionaries(
            {},
            optional={
                "type": st.sampled_from(TYPES),
                "properties": st.dictionaries(st.sampled_from("abc"), inner, max_size=3),
                "required": st.lists(st.sampled_from("abc"), max_size=2, unique=True),
                "additionalProperties": st.booleans() | inner,
                "items": inner,
                "anyOf": st.lists(inner, min_size=1, max_size=2),
                "allOf": st.lists(inner, min_size=1, max_size=2),
            },
        ),
        max_leaves=6,
    )


@settings(max_examples=1500, deadline=None)
@given(schemas(), values)
def test_agrees_with_jsonschema(schema: dict[str, Any], value: Any) -> None:
    expected = jsonschema.Draft202012Validator(schema).is_valid(value)
    assert (violation(value, schema) is None) == expected, (schema, value, violation(value, schema))


def test_refs_and_messages() -> None:
    schema = {
        "$defs": {
            "city": {
                "type": "object",
                "required": ["name"],
                "additionalProperties": False,
                "properties": {"name": {"type": "string"}},
            }
        },
        "type": "object",
        "properties": {"cities": {"type": "array", "items": {"$ref": "#/$defs/city"}}},
    }
    assert violation({"cities": [{"name": "Oslo"}]}, schema) is None
    assert (
        violation({"cities": [{"name": 3}]}, schema)
        == "$.cities[0].name: expected string, got number"
    )
    assert violation({"cities": [{}]}, schema) == "$.cities[0]: missing required property 'name'"
    assert (
        violation({"cities": [{"name": "x", "y": 1}]}, schema)
        == "$.cities[0]: property 'y' is not allowed"
    )
    # What it does not read passes: an unknown keyword, a remote or broken $ref.
    assert violation("x", {"format": "email", "pattern": "^y"}) is None
    assert violation(1, {"$ref": "https://example.com/s.json"}) is None
    assert violation(1, {"$ref": "#/nowhere"}) is None
    assert violation(True, {"type": "integer"}) is not None


def test_a_type_list_holding_no_names_is_read_as_unknown_types() -> None:
    # A client's schema may hold anything: a list or an object where a type's name goes is
    # a type the checker does not know, so anything fits it (no TypeError on the way).
    assert violation(1, {"type": [["string"]]}) is None
    assert violation({"a": 1}, {"properties": {"a": {"type": ["string", {"x": 1}]}}}) is None
    expected = "$: expected one of string, null, got number"
    assert violation(1, {"type": ["string", "null"]}) == expected


def test_a_schema_that_doubles_its_walk_is_given_up_on_in_bounded_time() -> None:
    # allOf of two references to the root doubles the walk at every level, 2**64 nodes:
    # after MAX_STEPS the value passes unjudged, as for a schema too deep to read.
    schema = {"allOf": [{"$ref": "#"}, {"$ref": "#"}]}
    assert violation(1, schema) is None
    assert violation(1, {"anyOf": [{"$ref": "#"}, {"$ref": "#"}], "type": "string"}) is not None
