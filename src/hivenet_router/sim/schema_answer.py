"""A JSON value that fits a JSON schema, as an engine decoding under a grammar would give.

Structured output (OpenAI `response_format: json_schema`, Anthropic `output_format`) and
forced tool calls are answered with an instance of the schema the client sent, so that a
client which validates the answer (the SDKs' `parse()`, Pydantic, an agent's tool runner)
accepts it. The instance is deterministic: the same schema gives the same value.

What is covered: `type` (one or a list), `const`, `enum`, `nullable`, objects (`required`,
`properties`, `additionalProperties`, `minProperties`, `dependentRequired`), arrays
(`items`, `prefixItems`, `minItems`/`maxItems`, `uniqueItems`, `contains`), strings
(`minLength`/`maxLength`, common `format`s, a `pattern` met when a simple candidate fits),
numbers and integers (inclusive and exclusive bounds, `multipleOf`), `anyOf`/`oneOf` (the
first option that is not null), `allOf` (merged), and local `$ref`s into `$defs` or
`definitions`, recursive ones included (past a depth the smallest value is chosen: null
where allowed, no optional items). What is not: `not`, `if`/`then`/`else`, remote refs,
`patternProperties`, and a `pattern` no candidate fits (its value is then a plain string).
"""

from __future__ import annotations

import importlib
import math
import re
from typing import Any, Final

_DEEP: Final = 6  # past this depth only what the schema requires is generated
_DEEPEST: Final = 40  # a schema that requires itself without end gets null here
_FORMATS: Final = {
    "date-time": "2025-01-01T00:00:00Z",
    "date": "2025-01-01",
    "time": "00:00:00Z",
    "duration": "P1D",
    "email": "sim@example.com",
    "idn-email": "sim@example.com",
    "hostname": "example.com",
    "idn-hostname": "example.com",
    "ipv4": "192.0.2.1",
    "ipv6": "2001:db8::1",
    "uri": "https://example.com/sim",
    "iri": "https://example.com/sim",
    "uri-reference": "/sim",
    "iri-reference": "/sim",
    "uuid": "00000000-0000-4000-8000-000000000000",
    "regex": "sim",
    "json-pointer": "/sim",
    "relative-json-pointer": "0",
    "uri-template": "https://example.com/{sim}",
}
_CANDIDATES: Final = ("sim", "a", "A", "0", "1", "abc", "ABC", "a1", "sim-1", "x y", "")


def instance(schema: Any) -> Any:
    """A value that validates against `schema` (within what the module covers)."""
    return _Maker(schema).make(schema, 0, 0)


class _Maker:
    def __init__(self, root: Any) -> None:
        self.root = root

    def make(self, schema: Any, depth: int, variant: int) -> Any:
        """A value for `schema`; `variant` tells the items of a unique array apart."""
        if schema is True or schema == {}:
            return _text(variant)
        if not isinstance(schema, dict) or depth > _DEEPEST:
            return None
        schema = self._flatten(schema, depth)
        if "const" in schema:
            return schema["const"]
        enum = schema.get("enum")
        if isinstance(enum, list) and enum:
            return self._pick_enum(enum, variant)
        for key in ("anyOf", "oneOf"):
            options = schema.get(key)
            if isinstance(options, list) and options:
                rest = {k: v for k, v in schema.items() if k != key}
                chosen = self._option(options, depth)
                return self.make({**rest, **chosen} if rest else chosen, depth, variant)
        kind = self._kind(schema, depth)
        if kind == "null":
            return None
        if kind == "object":
            return self._object(schema, depth)
        if kind == "array":
            return self._array(schema, depth)
        if kind == "integer":
            return _integer(schema, variant)
        if kind == "number":
            return _number(schema, variant)
        if kind == "boolean":
            return variant % 2 == 0
        return _string(schema, variant)

    # -- references and combinations -------------------------------------------------------

    def _flatten(self, schema: dict[str, Any], depth: int) -> dict[str, Any]:
        """`schema` with its `$ref` resolved and its `allOf` merged in."""
        ref = schema.get("$ref")
        if isinstance(ref, str):
            target = self._resolve(ref)
            rest = {k: v for k, v in schema.items() if k != "$ref"}
            schema = {**target, **rest} if isinstance(target, dict) else rest
        parts = schema.get("allOf")
        if isinstance(parts, list) and parts:
            merged = {k: v for k, v in schema.items() if k != "allOf"}
            for part in parts:
                if isinstance(part, dict):
                    merged = _merge(merged, self._flatten(part, depth))
            schema = merged
        return schema

    def _resolve(self, ref: str) -> Any:
        if ref == "#":
            return self.root
        if not ref.startswith("#/"):
            return {}  # a remote reference: nothing to go on
        node = self.root
        for raw in ref[2:].split("/"):
            part = raw.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return {}
        return node

    def _option(self, options: list[Any], depth: int) -> Any:
        """The first option that is not null; deep down, null where it is one."""
        nulls = [o for o in options if isinstance(o, dict) and o.get("type") == "null"]
        if depth >= _DEEP and nulls:
            return nulls[0]
        for option in options:
            if not (isinstance(option, dict) and option.get("type") == "null"):
                return option
        return options[0]

    @staticmethod
    def _pick_enum(enum: list[Any], variant: int) -> Any:
        values = [v for v in enum if v is not None] or enum
        return values[variant % len(values)]

    @staticmethod
    def _kind(schema: dict[str, Any], depth: int) -> str:
        kind = schema.get("type")
        if isinstance(kind, list):
            kinds = [k for k in kind if isinstance(k, str)]
            if "null" in kinds and depth >= _DEEP:
                return "null"
            kind = next((k for k in kinds if k != "null"), "null")
        elif schema.get("nullable") is True and depth >= _DEEP:
            return "null"
        if isinstance(kind, str):
            return kind
        if "properties" in schema or "required" in schema:
            return "object"
        if "items" in schema or "prefixItems" in schema:
            return "array"
        return "string"

    # -- containers ---------------------------------------------------------------------------

    def _object(self, schema: dict[str, Any], depth: int) -> dict[str, Any]:
        props = schema.get("properties")
        props = props if isinstance(props, dict) else {}
        extra = schema.get("additionalProperties", True)
        required = [n for n in schema.get("required", []) if isinstance(n, str)]
        names = list(dict.fromkeys(required))
        dependent = schema.get("dependentRequired")
        if isinstance(dependent, dict):
            for present in list(names):
                more = dependent.get(present)
                names += [n for n in more or [] if isinstance(n, str) and n not in names]
        least = schema.get("minProperties")
        if isinstance(least, int):
            names += [n for n in props if n not in names][: max(least - len(names), 0)]
            names += [f"sim_{i}" for i in range(max(least - len(names), 0))]
        out: dict[str, Any] = {}
        for name in names:
            sub = props.get(name, extra if isinstance(extra, dict) else True)
            out[name] = self.make(sub, depth + 1, 0)
        return out

    def _array(self, schema: dict[str, Any], depth: int) -> list[Any]:
        prefix = schema.get("prefixItems")
        prefix = prefix if isinstance(prefix, list) else []
        items = schema.get("items", True)
        if isinstance(items, list):  # draft 4-2019 tuples
            prefix, items = items, schema.get("additionalItems", True)
        least = schema.get("minItems")
        least = least if isinstance(least, int) and least > 0 else 0
        most = schema.get("maxItems")
        most = most if isinstance(most, int) and most >= 0 else None
        want = max(least, 1 if depth < _DEEP and items is not False else 0)
        if most is not None:
            want = min(want, most)
        if items is False:
            want = min(want, len(prefix))
        unique = schema.get("uniqueItems") is True
        contains = schema.get("contains")
        out: list[Any] = []
        for index in range(want):
            if index < len(prefix):
                sub = prefix[index]
            elif index == 0 and isinstance(contains, dict):
                sub = contains
            else:
                sub = items
            out.append(self.make(sub, depth + 1, index if unique else 0))
        if isinstance(contains, dict) and not out and (most is None or most > 0):
            out.append(self.make(contains, depth + 1, 0))
        return out


def _merge(base: dict[str, Any], part: dict[str, Any]) -> dict[str, Any]:
    """Two schemas an instance must both meet, as one (for what this module reads)."""
    merged = {**part, **base}
    for key in ("properties", "$defs", "definitions"):
        if isinstance(base.get(key), dict) or isinstance(part.get(key), dict):
            merged[key] = {**(part.get(key) or {}), **(base.get(key) or {})}
    required = [*(base.get("required") or []), *(part.get("required") or [])]
    if required:
        merged["required"] = list(dict.fromkeys(required))
    for key, tighter in (("minimum", max), ("minLength", max), ("minItems", max)):
        if key in base and key in part:
            merged[key] = tighter(base[key], part[key])
    for key, tighter in (("maximum", min), ("maxLength", min), ("maxItems", min)):
        if key in base and key in part:
            merged[key] = tighter(base[key], part[key])
    return merged


# -- scalars ----------------------------------------------------------------------------------


def _text(variant: int) -> str:
    return "sim" if not variant else f"sim-{variant}"


def _string(schema: dict[str, Any], variant: int) -> str:
    fmt = schema.get("format")
    text = _FORMATS.get(fmt, "") if isinstance(fmt, str) else ""
    if text and variant:
        text = _formatted_variant(fmt, text, variant)
    if not text:
        text = _text(variant)
    least = schema.get("minLength")
    least = least if isinstance(least, int) and least > 0 else 0
    most = schema.get("maxLength")
    most = most if isinstance(most, int) and most >= 0 else None
    pattern = schema.get("pattern")
    if not isinstance(pattern, str):
        return _fit_length(text, least, most)
    try:
        compiled = re.compile(pattern)
    except re.error:
        return _fit_length(text, least, most)
    made = _from_pattern(pattern)
    for candidate in (text, *([made] if made is not None else []), *_CANDIDATES):
        fitted = _fit_length(candidate, least, most)
        if compiled.search(fitted):
            return fitted
    return made if made is not None else text


def _fit_length(text: str, least: int, most: int | None) -> str:
    if len(text) < least:
        text += (text[-1:] or "x") * (least - len(text))  # more of the same keeps a pattern
    if most is not None and len(text) > most:
        text = text[:most]
    return text


def _from_pattern(pattern: str) -> str | None:
    """A short string the regular expression matches, from its parse tree; None for a
    construct this does not follow."""
    try:
        return _Pattern().make(_RE_PARSER.parse(pattern))
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError):
        return None


# The standard library's own regular-expression parser (no public API, no type stubs).
_RE_PARSER: Any = importlib.import_module("re._parser")
_CLASS_CHARS: Final = {
    "CATEGORY_DIGIT": "0",
    "CATEGORY_NOT_DIGIT": "a",
    "CATEGORY_WORD": "a",
    "CATEGORY_NOT_WORD": "-",
    "CATEGORY_SPACE": " ",
    "CATEGORY_NOT_SPACE": "a",
}


class _Pattern:
    def __init__(self) -> None:
        self.groups: dict[int, str] = {}

    def make(self, items: Any) -> str:
        return "".join(self._one(str(op), arg) for op, arg in items)

    def _one(self, op: str, arg: Any) -> str:
        if op == "LITERAL":
            return chr(arg)
        if op == "NOT_LITERAL":
            return "a" if chr(arg) != "a" else "b"
        if op == "ANY":
            return "a"
        if op == "IN":
            return _in_class(arg)
        if op == "CATEGORY":
            return _CLASS_CHARS[str(arg)]
        if op in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
            low, high, sub = arg
            count: int = min(max(low, 1), high)
            return self.make(sub) * count
        if op in ("SUBPATTERN", "ATOMIC_GROUP"):
            group, sub = (arg[0], arg[-1]) if op == "SUBPATTERN" else (None, arg)
            text = self.make(sub)
            if group is not None:
                self.groups[group] = text
            return text
        if op == "BRANCH":
            return self.make(arg[1][0])
        if op == "GROUPREF":
            return self.groups[arg]
        if op in ("AT", "ASSERT", "ASSERT_NOT"):
            return ""
        raise ValueError(op)


def _in_class(items: Any) -> str:
    """A character of a class `[...]`."""
    if items and str(items[0][0]) == "NEGATE":
        for char in "a0_-x ":
            if not any(_class_has(str(op), arg, char) for op, arg in items[1:]):
                return char
        raise ValueError("negated class")
    op, arg = str(items[0][0]), items[0][1]
    if op == "LITERAL":
        return chr(arg)
    if op == "RANGE":
        return chr(arg[0])
    if op == "CATEGORY":
        return _CLASS_CHARS[str(arg)]
    raise ValueError(op)


def _class_has(op: str, arg: Any, char: str) -> bool:
    if op == "LITERAL":
        return chr(arg) == char
    if op == "RANGE":
        return bool(arg[0] <= ord(char) <= arg[1])
    if op == "CATEGORY":
        return _CLASS_CHARS.get(str(arg)) == char or (
            str(arg) == "CATEGORY_WORD" and (char.isalnum() or char == "_")
        )
    return True


def _formatted_variant(fmt: Any, text: str, variant: int) -> str:
    """Distinct values of a format, for the items of a unique array."""
    if fmt in ("date-time", "date"):
        return text.replace("01-01", f"01-{1 + variant % 28:02d}", 1)
    if fmt == "uuid":
        return text[: -len(str(variant))] + str(variant)
    if fmt in ("email", "idn-email"):
        return f"sim{variant}@example.com"
    if fmt in ("uri", "iri"):
        return f"{text}/{variant}"
    return text


def _bounds(schema: dict[str, Any]) -> tuple[float | None, bool, float | None, bool]:
    """(low, low excluded, high, high excluded), in both the old boolean form of the
    exclusive bounds and the numeric one."""
    low = schema.get("minimum")
    high = schema.get("maximum")
    low = low if _is_number(low) else None
    high = high if _is_number(high) else None
    low_out = high_out = False
    ex_low, ex_high = schema.get("exclusiveMinimum"), schema.get("exclusiveMaximum")
    if ex_low is True:
        low_out = low is not None
    elif _is_number(ex_low) and (low is None or ex_low >= low):
        low, low_out = ex_low, True
    if ex_high is True:
        high_out = high is not None
    elif _is_number(ex_high) and (high is None or ex_high <= high):
        high, high_out = ex_high, True
    return low, low_out, high, high_out


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _step(schema: dict[str, Any]) -> float | None:
    """The schema's `multipleOf`, when it is a positive number."""
    step: Any = schema.get("multipleOf")
    if not _is_number(step) or step <= 0:
        return None
    return float(step)


def _integer(schema: dict[str, Any], variant: int) -> int:
    low, low_out, high, high_out = _bounds(schema)
    lo = None if low is None else (math.floor(low) + 1 if low_out else math.ceil(low))
    hi = None if high is None else (math.ceil(high) - 1 if high_out else math.floor(high))
    step = _step(schema)
    step = int(step) if step is not None and step >= 1 and step.is_integer() else 1
    start = lo if lo is not None else (min(1, hi) if hi is not None else 1)
    value = -(-start // step) * step + variant * step
    if hi is not None and value > hi:
        value = (hi // step) * step  # the largest multiple in range (a narrow range: one)
    return int(value)


def _number(schema: dict[str, Any], variant: int) -> float | int:
    step = _step(schema)
    if step is not None and not step.is_integer():
        return _fractional_multiple(schema, step, variant)
    if step is not None or schema.get("type") == "integer":
        return _integer(schema, variant)
    low, low_out, high, high_out = _bounds(schema)
    if low is None and high is None:
        return 1.0 + variant
    if low is None:
        assert high is not None
        value = min(1.0, high - 1.0 if high_out else high) + 0.0
        return value - variant
    value = float(low) + (1.0 if low_out else 0.0) + variant
    if high is not None and (value > high or (high_out and value >= high)):
        value = (float(low) + float(high)) / 2 if low_out or high_out else float(low)
    return value


def _fractional_multiple(schema: dict[str, Any], step: float, variant: int) -> float:
    """A multiple of a fractional step within the bounds: a whole number of steps, chosen
    so that the quotient is exact in binary floating point wherever it can be."""
    low, low_out, high, high_out = _bounds(schema)
    count = 0 if low is None else math.ceil(low / step)
    if low is not None and low_out and count * step <= low:
        count += 1
    count += variant
    if high is not None:
        top = math.floor(high / step)
        if high_out and top * step >= high:
            top -= 1
        count = min(count, top)
    # A validator divides the value by the step and wants a whole number back: 3 * 0.1 is
    # 0.30000000000000004, which fails, so a nearby count whose product divides cleanly
    # is preferred.
    for offset in range(64):
        for tried in (count + offset, count - offset):
            value = tried * step
            if (value / step).is_integer() and _inside(value, low, low_out, high, high_out):
                return value
    return count * step


def _inside(value: float, low: Any, low_out: bool, high: Any, high_out: bool) -> bool:
    if low is not None and (value < low or (low_out and value <= low)):
        return False
    return high is None or not (value > high or (high_out and value >= high))
