"""Does a JSON value fit a JSON schema? The part of JSON Schema that structured output and
tool definitions use, checked by hand: `type`, `enum`, `const`, `required`, `properties`,
`additionalProperties`, `items`, `anyOf`/`oneOf`/`allOf` and local `$ref`s (`#/$defs/...`,
`#/definitions/...`).

Lenient by design: a keyword outside that subset, a malformed schema part or a `$ref` that
does not resolve passes, so a schema the checker does not understand never rejects a
model's answer (the validator would otherwise replace sound answers). The `jsonschema`
package is a development dependency only (the tests check this against it); the router does
not need it at run time.

Pure: no I/O.
"""

from __future__ import annotations

from typing import Any, Final

MAX_DEPTH: Final = 64  # nesting of values and of schema references followed
# Nodes one check may visit. The schema is the client's: `allOf` or `anyOf` of references
# back to the root doubles the walk at each level, so a few hundred bytes of schema could
# hold the event loop for minutes. Past this many (about 50 ms), the value passes unjudged.
MAX_STEPS: Final = 50_000


class _Walk:
    """One check's schema root and the steps it has left."""

    __slots__ = ("root", "steps")

    def __init__(self, root: Any) -> None:
        self.root = root
        self.steps = MAX_STEPS


class _TooLong(Exception):
    """The walk ran out of steps."""


# Where a value is: None for the document's root, else (where its parent is, its key or
# index). Built as the walk goes down, cheaply; spelled out (`$.items[2].name`) only for a
# value that does not fit.
Where = tuple[Any, "str | int"] | None


def violation(value: Any, schema: Any) -> str | None:
    """Why `value` does not fit `schema`, naming where (`$.items[2].name`); None if it fits
    (or the schema says nothing the checker reads)."""
    try:
        return _check(value, schema, _Walk(schema), None, 0)
    except _TooLong:
        return None  # too costly to judge: anything goes, as for a schema part too deep


def spelled(where: Where) -> str:
    """A place as the reasons name it: `$`, `$.name`, `$.items[2]`."""
    parts: list[str] = []
    while where is not None:
        where, key = where
        parts.append(f"[{key}]" if isinstance(key, int) else f".{key}")
    return "$" + "".join(reversed(parts))


def _check(value: Any, schema: Any, walk: _Walk, where: Where, depth: int) -> str | None:
    if type(schema) is not dict or depth > MAX_DEPTH:
        return None  # `true`, `{}`, or too deep to judge: anything goes
    walk.steps -= 1
    if walk.steps < 0:
        raise _TooLong
    if "$ref" in schema:
        ref = schema["$ref"]
        if isinstance(ref, str):
            problem = _check(value, _resolve(walk.root, ref), walk, where, depth + 1)
            if problem is not None:
                return problem
    problem = _kind(value, schema, where)
    if problem is not None:
        return problem
    if "allOf" in schema or "anyOf" in schema or "oneOf" in schema:
        problem = _choices(value, schema, walk, where, depth)
        if problem is not None:
            return problem
    kind = type(value)
    if kind is dict:
        return _object(value, schema, walk, where, depth)
    if kind is list:
        items = schema.get("items")
        if type(items) is dict:
            depth += 1
            for index, item in enumerate(value):
                problem = _check(item, items, walk, (where, index), depth)
                if problem is not None:
                    return problem
    return None


def _resolve(root: Any, ref: str) -> Any:
    """A local reference's target; None (anything goes) when it leaves the document."""
    if not ref.startswith("#"):
        return None
    node = root
    for raw in ref[1:].split("/")[1:] if ref != "#" else []:
        part = raw.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


# The JSON kinds a parsed value of each type is (a float with no fraction is an integer too).
_KINDS: Final[dict[type, frozenset[str]]] = {
    str: frozenset({"string"}),
    int: frozenset({"integer", "number"}),
    float: frozenset({"number"}),
    bool: frozenset({"boolean"}),
    type(None): frozenset({"null"}),
    dict: frozenset({"object"}),
    list: frozenset({"array"}),
}
_KNOWN: Final = frozenset({"string", "integer", "number", "boolean", "null", "object", "array"})


def _is(value: Any, kind: Any) -> bool:
    if not isinstance(kind, str):
        return True  # not a type's name: a type the checker does not know
    kinds = _KINDS.get(type(value))
    if kinds is None:  # not what a JSON parser makes: judged by what it is an instance of
        kinds = next((k for t, k in _KINDS.items() if isinstance(value, t)), frozenset())
    if kind in kinds:
        return True
    if kind == "integer" and isinstance(value, float):
        return value.is_integer()
    return kind not in _KNOWN  # a type the checker does not know


def _kind(value: Any, schema: dict[str, Any], where: Where) -> str | None:
    if "type" in schema:
        kind = schema["type"]
        if isinstance(kind, str):
            if not _is(value, kind):
                return f"{spelled(where)}: expected {kind}, got {_name(value)}"
        elif isinstance(kind, list) and kind and not any(_is(value, k) for k in kind):
            expected = ", ".join(map(str, kind))
            return f"{spelled(where)}: expected one of {expected}, got {_name(value)}"
    if "enum" in schema:
        enum = schema["enum"]
        if isinstance(enum, list) and not any(_same(value, option) for option in enum):
            return f"{spelled(where)}: not one of the enum's values"
    if "const" in schema and not _same(value, schema["const"]):
        return f"{spelled(where)}: not the const value"
    return None


def _same(a: Any, b: Any) -> bool:
    """JSON equality: 1 and 1.0 are equal, true and 1 are not."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    return bool(a == b)


def _choices(
    value: Any, schema: dict[str, Any], walk: _Walk, where: Where, depth: int
) -> str | None:
    every = schema.get("allOf")
    if isinstance(every, list):
        for part in every:
            problem = _check(value, part, walk, where, depth + 1)
            if problem is not None:
                return problem
    for key in ("anyOf", "oneOf"):  # oneOf is read as anyOf: lenient, never stricter
        options = schema.get(key)
        if (
            isinstance(options, list)
            and options
            and all(_check(value, o, walk, where, depth + 1) is not None for o in options)
        ):
            return f"{spelled(where)}: fits none of {key}"
    return None


def _object(
    value: dict[str, Any], schema: dict[str, Any], walk: _Walk, where: Where, depth: int
) -> str | None:
    required = schema.get("required")
    if isinstance(required, list):
        for name in required:
            if isinstance(name, str) and name not in value:
                return f"{spelled(where)}: missing required property {name!r}"
    properties = schema.get("properties")
    if type(properties) is not dict:
        properties = {}
    extra = schema.get("additionalProperties")
    depth += 1
    for name, item in value.items():
        if name in properties:
            problem = _check(item, properties[name], walk, (where, name), depth)
        elif extra is False:
            problem = f"{spelled(where)}: property {name!r} is not allowed"
        elif type(extra) is dict:
            problem = _check(item, extra, walk, (where, name), depth)
        else:
            continue
        if problem is not None:
            return problem
    return None


def _name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"
