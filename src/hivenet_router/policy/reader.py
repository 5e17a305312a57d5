"""The policy YAML reader: walks the node tree so every error names file, line and field.

Any layer parses its own policy section with it (`policy/blocks.py`): a mistake is refused
at start and at reload as `policy.yaml:14: response_cache.ttl_seconds: must be between ...`.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from typing import Any, TypeVar

import yaml

MAX_COUNT = 10**15
# A number written with an exponent and no dot (`1e3`, `2.5E-4` has one), as JSON and
# Python's json.dumps write them: YAML 1.1, which PyYAML reads, takes `1e3` for a string,
# while the policy API takes JSON as YAML. Read as a number where a number is expected.
_EXPONENT = re.compile(r"[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)[eE][-+]?[0-9]+")

S = TypeVar("S")


class PolicyError(Exception):
    """A policy document that cannot be used; the message names file, line and field."""


class Reader:
    """Reads the values of one policy document; `source` names it in every error."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, node: yaml.Node | None, path: str, message: str) -> PolicyError:
        line = f":{node.start_mark.line + 1}" if node is not None else ""
        return PolicyError(f"{self.source}{line}: {path}: {message}")

    def mapping(self, node: yaml.Node, path: str, allowed: tuple[str, ...]) -> dict[str, yaml.Node]:
        """A mapping's value nodes by key; `allowed` empty accepts any string key."""
        if not isinstance(node, yaml.MappingNode):
            raise self.fail(node, path, "must be a mapping")
        out: dict[str, yaml.Node] = {}
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            if not isinstance(key, str):
                raise self.fail(key_node, path, "keys must be strings")
            if key in out:
                raise self.fail(key_node, f"{path}.{key}", "appears twice")
            if allowed and key not in allowed:
                raise self.fail(
                    key_node, f"{path}.{key}", f"unknown field (allowed: {', '.join(allowed)})"
                )
            out[key] = value_node
        return out

    def scalar(self, node: yaml.Node, path: str) -> Any:
        if not isinstance(node, yaml.ScalarNode):
            raise self.fail(node, path, "must be a single value")
        if node.tag == "tag:yaml.org,2002:null":
            return None  # `field:` with nothing after it (or `~`, `null`): no value
        try:
            return yaml.safe_load(yaml.serialize(node))
        except (yaml.YAMLError, ValueError, OverflowError) as exc:
            # A tag the safe loader refuses (`!!python/name:...`) or one it cannot apply
            # (`!!int two`): a policy error with its line, never a traceback.
            problem = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise self.fail(node, path, f"is not a plain value ({problem})") from None

    def string(self, node: yaml.Node, path: str, allow_empty: bool = True) -> str:
        value = self.scalar(node, path)
        if not isinstance(value, str) or (not allow_empty and not value):
            raise self.fail(
                node, path, "must be a non-empty string" if not allow_empty else "must be a string"
            )
        return value

    def count(self, node: yaml.Node, path: str) -> int:
        value = self.scalar(node, path)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(node, path, "must be an integer")
        if value < 0:
            raise self.fail(node, path, "must not be negative")
        if value > MAX_COUNT:
            # Counts meet floats in the gates (a 400-digit budget overflowed on every
            # request); no token budget or limit comes near this.
            raise self.fail(node, path, f"is out of range (at most {MAX_COUNT:.0e})")
        return value

    def number(self, node: yaml.Node, path: str) -> float:
        value = self.scalar(node, path)
        plain = isinstance(node, yaml.ScalarNode) and node.style is None
        if isinstance(value, str) and plain and _EXPONENT.fullmatch(value):
            value = float(value)  # a plain `1e3`; a quoted "1e3" stays a string
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.fail(node, path, "must be a number")
        try:
            number = float(value)
        except OverflowError:
            number = math.inf
        if not math.isfinite(number):
            # A .nan threshold compares false with everything: a gate that never fires.
            raise self.fail(node, path, "must be a finite number")
        return number

    def strings(self, node: yaml.Node, path: str) -> tuple[str, ...]:
        if not isinstance(node, yaml.SequenceNode):
            raise self.fail(node, path, "must be a list of strings")
        return tuple(
            self.string(item, f"{path}[{i}]", allow_empty=False)
            for i, item in enumerate(node.value)
        )

    def settings(
        self,
        node: yaml.Node,
        path: str,
        kind: type[S],
        check: Callable[[S], str | None],
        complete: Callable[[dict[str, Any]], None] | None = None,
    ) -> S:
        """A frozen settings dataclass from a mapping of its fields, range-checked by `check`
        (which names the first bad field as `<block>.<field>: <why>`)."""
        declared = {f.name: f for f in dataclasses.fields(kind)}  # type: ignore[arg-type]
        items = self.mapping(node, path, tuple(declared))
        values: dict[str, Any] = {}
        for name, value in items.items():
            where = f"{path}.{name}"
            wanted = declared[name].type
            raw = self.scalar(value, where)
            if wanted == "bool":
                if not isinstance(raw, bool):
                    raise self.fail(value, where, "must be true or false")
                values[name] = raw
            elif wanted == "int":
                if isinstance(raw, bool) or not isinstance(raw, int):
                    raise self.fail(value, where, "must be an integer")
                values[name] = raw
            else:
                values[name] = self.number(value, where)
        if complete is not None:
            complete(values)  # defaults that follow what was set (a window smaller than 10)
        made = kind(**values)
        problem = check(made)
        if problem:
            field, _, why = problem.partition(": ")
            name = field.rpartition(".")[2]
            raise self.fail(items.get(name, node), f"{path}.{name}", why)
        return made
