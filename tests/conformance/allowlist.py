"""Where an answer that passes through the router departs from the official specifications.

Keys are (backend, spec, schema, JSON path, validator), as tests/conformance/specs.py
reports them; a missing property is named in the path. The router adds no entry of its own:
every entry is about bytes the engine wrote and the router relayed untouched, and each group
says what the engine does. The simulator is this project's and has no entry but the first,
which is the specification's own slip.
"""

from __future__ import annotations

Key = tuple[str, str, str, str, str]

# OpenAI's document gives /completions stream chunks the non-streaming schema, whose
# finish_reason may not be null; every chunk but the last carries null, as OpenAI's API
# itself sends. Both backends follow the API, not the document.
_STREAM_FINISH_NULL: list[Key] = [
    (backend, "openai", "CreateCompletionResponse", "$.choices[0].finish_reason", check)
    for backend in ("sim", "llamacpp")
    for check in ("type", "enum")
]

# llama.cpp (b11434) leaves out the fields OpenAI's spec marks required but null when unused.
_LLAMACPP_OPENAI: list[Key] = [
    ("llamacpp", "openai", "CreateChatCompletionResponse", path, "required")
    for path in ("$.choices[0].logprobs", "$.choices[0].message.refusal")
]


def _missing(schema: str, base: str, names: tuple[str, ...]) -> list[Key]:
    return [("llamacpp", "anthropic", schema, f"{base}.{name}", "required") for name in names]


# llama.cpp's Anthropic endpoint writes the fields the SDK reads and none of the newer ones
# Anthropic's document marks required-but-nullable (caching, containers, citations, tiers).
_USAGE = (
    "cache_creation",
    "cache_creation_input_tokens",
    "inference_geo",
    "output_tokens_details",
    "server_tool_use",
    "service_tier",
)
_DELTA_USAGE = (
    "cache_creation_input_tokens",
    "cache_read_input_tokens",
    "input_tokens",
    "output_tokens_details",
    "server_tool_use",
)
_LLAMACPP_ANTHROPIC: list[Key] = [
    *_missing("Message", "$", ("container", "stop_details")),
    *_missing("Message", "$.content[0]", ("citations",)),
    *_missing("Message", "$.usage", _USAGE),
    *_missing("MessageStartEvent", "$.message", ("container", "stop_details")),
    *_missing("MessageStartEvent", "$.message.usage", _USAGE),
    *_missing("ContentBlockStartEvent", "$.content_block", ("citations",)),
    *_missing("MessageDeltaEvent", "$.delta", ("container", "stop_details")),
    *_missing("MessageDeltaEvent", "$.usage", _DELTA_USAGE),
]

ALLOWED: frozenset[Key] = frozenset([*_STREAM_FINISH_NULL, *_LLAMACPP_OPENAI, *_LLAMACPP_ANTHROPIC])
