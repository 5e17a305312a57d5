"""One request as the router sees it: the facts read from its body, the usage its answer
reports, and the job dispatch carries to an agent."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RequestFacts:
    """What routing and admission read from a body (router/bodies.py decodes it)."""

    route: str
    model: str
    capability: str
    stream: bool
    # The declared output of the whole request (max_tokens times n); None: undeclared
    # (absent, null or negative).
    max_output_tokens: int | None
    text_bytes: int = 0  # prompt text, system prompt and raw tool JSON, for the estimate
    messages: int = 0
    images: int = 0
    # The prompt's text pieces in the order the model reads them (system, then each
    # message's role and text), for prefix-aware routing. References to the decoded
    # strings, not copies.
    prompt: tuple[str, ...] = ()
    # `n` (times the prompts of a completions batch): answers, each up to max_tokens
    choices: int = 1
    # A limit field the router did not count is in the body (`n_predict: -1` beside a
    # `max_tokens` it counted, say): the output bound must be written in even where it
    # equals what was counted, or the engine reads that field as no limit.
    loose_limit: bool = False


@dataclass(frozen=True, slots=True)
class Usage:
    """Tokens an answer reported (OpenAI and Anthropic names normalised)."""

    input_tokens: int
    output_tokens: int


@dataclass(frozen=True, slots=True)
class Job:
    """What travels to the agent: the route and the original bytes, with the headers to
    forward."""

    route: str
    model: str
    capability: str
    stream: bool
    body: bytes
    headers: list[tuple[str, str]]
