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


def violation(value: Any, schema: Any) -> str | None:
    """Why `value` does not fit `schema`, naming where (`$.items[2].name`); None if it fits
    (or the schema says nothing the checker reads)."""
    return _check(value, schema, schema, "$", 0)


def _check(value: Any, schema: Any, root: Any, path: str, depth: int) -> str | None:
    if not isinstance(schema, dict) or depth > MAX_DEPTH:
        return None  # `true`, `{}`, or too deep to judge: anything goes
    ref = schema.get("$ref")
    if isinstance(ref, str):
        target = _resolve(root, ref)
        problem = _check(value, target, root, path, depth + 1)
        if problem is not None:
            return problem
    problem = _kind(value, schema, path)
    if problem is not None:
        return problem
    problem = _choices(value, schema, root, path, depth)
    if problem is not None:
        return problem
    if isinstance(value, dict):
        return _object(value, schema, root, path, depth)
    if isinstance(value, list):
        items = schema.get("items")
        if isinstance(items, dict):
            for index, item in enumerate(value):
                problem = _check(item, items, root, f"{path}[{index}]", depth + 1)
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


def _is(value: Any, kind: Any) -> bool:
    if kind == "string":
        return isinstance(value, str)
    if kind == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)) or (
            isinstance(value, float) and value.is_integer()
        )
    if kind == "number":
        return isinstance(value, int | float) and not isinstance(value, bool)
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "null":
        return value is None
    if kind == "object":
        return isinstance(value, dict)
    if kind == "array":
        return isinstance(value, list)
    return True  # a type the checker does not know


def _kind(value: Any, schema: dict[str, Any], path: str) -> str | None:
    kind = schema.get("type")
    if isinstance(kind, str) and not _is(value, kind):
        return f"{path}: expected {kind}, got {_name(value)}"
    if isinstance(kind, list) and kind and not any(_is(value, k) for k in kind):
        return f"{path}: expected one of {', '.join(map(str, kind))}, got {_name(value)}"
    enum = schema.get("enum")
    if isinstance(enum, list) and not any(_same(value, option) for option in enum):
        return f"{path}: not one of the enum's values"
    if "const" in schema and not _same(value, schema["const"]):
        return f"{path}: not the const value"
    return None


def _same(a: Any, b: Any) -> bool:
    """JSON equality: 1 and 1.0 are equal, true and 1 are not."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    return bool(a == b)


def _choices(value: Any, schema: dict[str, Any], root: Any, path: str, depth: int) -> str | None:
    every = schema.get("allOf")
    if isinstance(every, list):
        for part in every:
            problem = _check(value, part, root, path, depth + 1)
            if problem is not None:
                return problem
    for key in ("anyOf", "oneOf"):  # oneOf is read as anyOf: lenient, never stricter
        options = schema.get(key)
        if (
            isinstance(options, list)
            and options
            and all(_check(value, o, root, path, depth + 1) is not None for o in options)
        ):
            return f"{path}: fits none of {key}"
    return None


def _object(
    value: dict[str, Any], schema: dict[str, Any], root: Any, path: str, depth: int
) -> str | None:
    required = schema.get("required")
    if isinstance(required, list):
        for name in required:
            if isinstance(name, str) and name not in value:
                return f"{path}: missing required property {name!r}"
    properties = schema.get("properties")
    properties = properties if isinstance(properties, dict) else {}
    extra = schema.get("additionalProperties")
    for name, item in value.items():
        if name in properties:
            problem = _check(item, properties[name], root, f"{path}.{name}", depth + 1)
        elif extra is False:
            problem = f"{path}: property {name!r} is not allowed"
        elif isinstance(extra, dict):
            problem = _check(item, extra, root, f"{path}.{name}", depth + 1)
        else:
            problem = None
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
