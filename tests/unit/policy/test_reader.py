"""The policy reader every layer parses its section with: each refusal names the source,
the line and the path it was given."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import yaml

from hivenet_router.policy.reader import PolicyError, Reader

READER = Reader("r.yaml")


def node(text: str) -> yaml.Node:
    root = yaml.compose(text)
    assert root is not None
    return root


def refused(text: str, read: str) -> str:
    with pytest.raises(PolicyError) as info:
        getattr(READER, read)(node(text), "x.y")
    return str(info.value)


def test_scalars_are_checked_where_they_are_read() -> None:
    assert READER.count(node("3"), "x") == 3
    assert READER.number(node("0.5"), "x") == 0.5
    assert READER.strings(node("[a, b]"), "x") == ("a", "b")
    assert refused("-1", "count") == "r.yaml:1: x.y: must not be negative"
    assert refused("true", "count") == "r.yaml:1: x.y: must be an integer"
    assert refused("\n\n.nan", "number") == "r.yaml:3: x.y: must be a finite number"
    assert refused("[a, '']", "strings") == "r.yaml:1: x.y[1]: must be a non-empty string"
    assert refused("{a: 1}", "scalar") == "r.yaml:1: x.y: must be a single value"
    assert refused("!!int two", "scalar").startswith("r.yaml:1: x.y: is not a plain value")


def test_mappings_refuse_unknown_and_repeated_keys() -> None:
    assert list(READER.mapping(node("{a: 1, b: 2}"), "x", ("a", "b"))) == ["a", "b"]
    with pytest.raises(PolicyError, match=r"^r\.yaml:2: x\.c: unknown field \(allowed: a, b\)"):
        READER.mapping(node("a: 1\nc: 2\n"), "x", ("a", "b"))
    with pytest.raises(PolicyError, match=r"^r\.yaml:2: x\.a: appears twice"):
        READER.mapping(node("a: 1\na: 2\n"), "x", ())
    with pytest.raises(PolicyError, match=r"^r\.yaml:1: x: must be a mapping"):
        READER.mapping(node("[1]"), "x", ())


@dataclass(frozen=True, slots=True)
class Knobs:
    size: int = 1
    ratio: float = 0.5
    on: bool = True


def check(knobs: Knobs) -> str | None:
    return "knobs.ratio: must be below 1" if knobs.ratio >= 1 else None


def test_settings_read_a_dataclass_by_its_field_types() -> None:
    assert READER.settings(node("{size: 2, on: false}"), "knobs", Knobs, check) == Knobs(
        2, 0.5, False
    )
    with pytest.raises(PolicyError, match=r"^r\.yaml:2: knobs\.ratio: must be below 1$"):
        READER.settings(node("size: 2\nratio: 3\n"), "knobs", Knobs, check)
    with pytest.raises(PolicyError, match=r"^r\.yaml:1: knobs\.on: must be true or false$"):
        READER.settings(node("{on: 1}"), "knobs", Knobs, check)
    with pytest.raises(PolicyError, match=r"^r\.yaml:1: knobs\.size: must be an integer$"):
        READER.settings(node("{size: 1.5}"), "knobs", Knobs, check)
