"""Generated inputs, valid and invalid, from the official specs against every public route.

schemathesis draws requests from the OpenAI and Anthropic documents (half of them with the
`model` swapped for one the router serves, so they reach an agent). The router must answer
each with a non-5xx status inside the timeout, must never refuse a body the official schema
accepts with its own validation (a 400 whose source is the router), and afterwards hold no
forwarding slot, agent slot, queue entry or token reservation. The shapes real clients send
(tools, tool results, JSON schemas, images, thinking, cache_control) are sent by hand too,
each first checked against the official request schema. The number of examples is
bounded: FUZZ_EXAMPLES (default 15 per route and mode, 255 requests, 35 to 42 s here) keeps
the CI run short; raise it for a longer run.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2 as httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import Case, GenerationMode

from tests.conformance import specs
from tests.procs import Router, cluster, metric, wait_registered, wait_until

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "15"))
CHAT, EMBED = "fuzz-chat", "fuzz-embed"

ROUTES = [
    ("openai", "/chat/completions", "POST"),
    ("openai", "/completions", "POST"),
    ("openai", "/embeddings", "POST"),
    ("openai", "/models", "GET"),
    ("openai", "/models/{model}", "GET"),
    ("openai", "/responses", "POST"),
    ("openai", "/responses/{response_id}", "GET"),
    ("openai", "/responses/{response_id}", "DELETE"),
    ("openai", "/responses/{response_id}/input_items", "GET"),
    ("openai", "/responses/{response_id}/cancel", "POST"),
    ("anthropic", "/v1/messages", "POST"),
    ("anthropic", "/v1/messages/count_tokens", "POST"),
    ("anthropic", "/v1/models", "GET"),
    ("anthropic", "/v1/models/{model_id}", "GET"),
]


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Router]:
    tmp: Path = tmp_path_factory.mktemp("fuzz")
    # A budget and a backstop, so that every request that generates holds an occupancy
    # reservation the leak check can see come and go.
    policy = tmp / "policy.yaml"
    policy.write_text(
        "admit_budget_tokens: 10000000\nmax_inflight: 1000\n"
        "routing_policy: {strategy: least-loaded}\n"
    )
    with cluster(tmp) as c:
        r = c.router("--policy-file", str(policy))
        chat = c.sim(CHAT, "--zero-latency", "--output-tokens", "8", name="sim-chat")
        embed = c.sim(EMBED, "--zero-latency", name="sim-embed")
        c.agent(r, chat, name="agent-chat")
        c.agent(r, embed, "--capability", "embedding", name="agent-embed")
        wait_registered(r, CHAT)
        wait_registered(r, EMBED)
        first = httpx.post(
            r.url + "/v1/chat/completions",
            json={"model": CHAT, "messages": [{"role": "user", "content": "hi"}]},
            timeout=10,
        )
        assert first.status_code == 200 and metric(r.metrics(), HELD[-1]) == 0.0
        yield r


def _aim(case: Case, model: str) -> None:
    """Point a generated body at a served model so the request gets past the model lookup."""
    if isinstance(case.body, dict):
        case.body["model"] = model
        for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            value = case.body.get(name)
            if isinstance(value, int | float) and not isinstance(value, bool):
                case.body[name] = type(value)(min(value, 64))


def _send(router: Router, spec: str, case: Case) -> httpx.Response:
    kwargs: dict[str, Any] = case.as_transport_kwargs(base_url=router.url + specs.PREFIX[spec])
    kwargs.pop("cookies", None)
    headers = {k: v for k, v in (kwargs.pop("headers", None) or {}).items() if _plain(k, v)}
    return httpx.request(
        kwargs.pop("method"),
        kwargs.pop("url"),
        headers=headers,
        params=kwargs.get("params"),
        content=kwargs.get("data") if "json" not in kwargs else None,
        json=kwargs.get("json"),
        timeout=15,
    )


def _plain(name: str, value: object) -> bool:
    """Headers an HTTP client can send at all (h11 refuses the rest before they leave)."""
    return (
        isinstance(value, str)
        and name.isascii()
        and value.isascii()
        and value == value.strip()
        and value.isprintable()
        and name.isprintable()
    )


# The request body each operation's schema describes, to tell a valid body from one
# schemathesis only believed valid.
REQUEST_SCHEMAS = {
    ("openai", "/chat/completions"): "CreateChatCompletionRequest",
    ("openai", "/completions"): "CreateCompletionRequest",
    ("openai", "/embeddings"): "CreateEmbeddingRequest",
    ("anthropic", "/v1/messages"): "CreateMessageParams",
    ("anthropic", "/v1/messages/count_tokens"): "CountMessageTokensParams",
    ("openai", "/responses"): "CreateResponse",
}
# Refusals of schema-valid bodies the router documents (docs/responses.md): hosted tools and
# features it does not offer, and values that cannot be served (a tool_choice naming no
# tool); each has its code.
DOCUMENTED_REFUSALS = frozenset({"unsupported_tool", "unsupported_parameter", "invalid_parameter"})


def _refused_by_router(reply: httpx.Response, path: str) -> bool:
    """A 400 whose envelope says the router itself refused the body (less, on /responses,
    the refusals the router documents)."""
    if reply.status_code != 400:
        return False
    try:
        error = reply.json().get("error")
    except ValueError:
        return False
    return (
        isinstance(error, dict)
        and error.get("source") == "router"
        and not (path == "/responses" and error.get("code") in DOCUMENTED_REFUSALS)
    )


# Anthropic declares every part of this request as a free string, so schemathesis has no
# invalid variant of it to draw (hypothesis reports the search unsatisfiable).
NO_NEGATIVE = {("anthropic", "/v1/models/{model_id}")}
CASES = [
    (spec, path, method, mode)
    for spec, path, method in ROUTES
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
    if not (mode is GenerationMode.NEGATIVE and (spec, path) in NO_NEGATIVE)
]


@pytest.mark.parametrize(("spec", "path", "method", "mode"), CASES)
def test_generated_requests_get_no_5xx_and_leak_nothing(
    router: Router, spec: str, path: str, method: str, mode: GenerationMode
) -> None:
    operation = specs.schemathesis_schema(spec)[path][method]
    model = EMBED if "embeddings" in path else CHAT
    statuses: list[int] = []
    refused: list[tuple[object, str]] = []

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode), aim=st.booleans())
    def one(case: Case, aim: bool) -> None:
        if aim:
            _aim(case, model)
        reply = _send(router, spec, case)
        statuses.append(reply.status_code)
        assert reply.status_code < 500, (case.body, reply.status_code, reply.text[:500])
        if aim and mode is GenerationMode.POSITIVE and _refused_by_router(reply, path):
            # Only a failure if the official schema really accepts the body (schemathesis
            # can stray from a schema it reads loosely).
            component = REQUEST_SCHEMAS.get((spec, path))
            if component is not None and not specs.violations(spec, component, case.body):
                refused.append((case.body, reply.text[:300]))

    one()
    assert statuses
    assert not refused, refused[:3]  # schema-valid bodies the router's own checks refused

    def drained() -> bool:
        text = router.metrics()
        held = {name: metric(text, name) for name in HELD}
        missing = [name for name, value in held.items() if value is None]
        assert not missing, f"the fixture's state is not where the check looks: {missing}"
        # Created only when a request had to wait for an agent: zero whenever it exists.
        waiting = metric(text, "hivenet_queue_depth")
        return not any(held.values()) and not waiting

    wait_until(drained, timeout=5)


# What a request holds while it is in flight, all of which the fixture creates (the
# occupancy pool with its first chat request).
HELD = (
    "hivenet_router_active_forwards",
    "hivenet_router_pending_requests",
    "hivenet_agent_capacity_utilization",
    "hivenet_agent_link_streams",
    "hivenet_admission_occupancy_tokens",
    "hivenet_admission_inflight_requests",
)


_TOOL_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}
_PIXEL = (
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4nGNgYGAAAAAEAAHiIbwzAAAAAElFTkSuQmCC"
)
_OPENAI_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": _TOOL_SCHEMA, "strict": True},
}
_ANTHROPIC_TOOL = {
    "name": "get_weather",
    "input_schema": _TOOL_SCHEMA,
    "cache_control": {"type": "ephemeral"},
}
_CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
_TURNS = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": [
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
        ],
    },
    {
        "role": "user",
        "content": [
            {
                "type": "tool_result",
                "tool_use_id": "toolu_1",
                "content": [{"type": "text", "text": "21C"}],
                "cache_control": {"type": "ephemeral"},
            }
        ],
    },
]
SHAPES: list[tuple[str, str, dict[str, Any]]] = [
    (
        "openai",
        "/chat/completions",
        {
            "messages": [{"role": "user", "content": "Weather?"}],
            "tools": [_OPENAI_TOOL],
            "tool_choice": "required",
            "parallel_tool_calls": False,
        },
    ),
    (
        "openai",
        "/chat/completions",
        {
            "messages": [
                {"role": "system", "content": "Use tools."},
                {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [_CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": "21C"},
            ],
            "tools": [_OPENAI_TOOL],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ),
    (
        "openai",
        "/chat/completions",
        {
            "messages": [{"role": "user", "content": "JSON please"}],
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "place", "schema": _TOOL_SCHEMA, "strict": True},
            },
        },
    ),
    (
        "openai",
        "/chat/completions",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "What is this?"},
                        {
                            "type": "image_url",
                            "image_url": {
                                "url": f"data:image/png;base64,{_PIXEL}",
                                "detail": "low",
                            },
                        },
                    ],
                }
            ],
            "max_completion_tokens": 8,
            "temperature": 0.2,
            "seed": 3,
            "user": "u",
        },
    ),
    ("openai", "/completions", {"prompt": [[1, 2, 3]], "max_tokens": 4, "echo": False}),
    (
        "anthropic",
        "/v1/messages",
        {
            "max_tokens": 64,
            "system": [
                {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}
            ],
            "tools": [_ANTHROPIC_TOOL],
            "tool_choice": {"type": "any"},
            "messages": _TURNS[:1],
            "metadata": {"user_id": "u"},
        },
    ),
    (
        "anthropic",
        "/v1/messages",
        {
            "max_tokens": 2048,
            "stream": True,
            "thinking": {"type": "enabled", "budget_tokens": 1024},
            "tools": [_ANTHROPIC_TOOL],
            "messages": _TURNS,
        },
    ),
    (
        "anthropic",
        "/v1/messages",
        {
            "max_tokens": 16,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image",
                            "source": {"type": "base64", "media_type": "image/png", "data": _PIXEL},
                        },
                        {"type": "text", "text": "What is this?"},
                    ],
                }
            ],
        },
    ),
    (
        "anthropic",
        "/v1/messages/count_tokens",
        {
            "system": "Be brief.",
            "tools": [_ANTHROPIC_TOOL],
            "messages": _TURNS,
        },
    ),
]


@pytest.mark.parametrize(
    ("spec", "path", "body"), SHAPES, ids=[f"{s}{p}-{i}" for i, (s, p, _) in enumerate(SHAPES)]
)
def test_the_shapes_real_clients_send(
    router: Router, spec: str, path: str, body: dict[str, Any]
) -> None:
    body = {"model": CHAT, **body}
    assert not specs.violations(spec, REQUEST_SCHEMAS[(spec, path)], body)  # valid for sure
    headers = {"anthropic-version": "2023-06-01"} if spec == "anthropic" else {}
    reply = httpx.post(
        router.url + specs.PREFIX[spec] + path, json=body, headers=headers, timeout=15
    )
    assert reply.status_code == 200, reply.text[:500]


def test_no_metric_label_takes_a_value_the_fuzzing_chose(router: Router) -> None:
    """Runs after the fuzzing above (same module-scoped router): thousands of generated
    bodies, model names and headers later, every label value is still one the router,
    the operator or an agent chose, so the number of series stays bounded."""
    text = router.metrics()
    series = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert series
    models = set(re.findall(r'\bmodel="([^"]*)"', text))
    assert models <= {CHAT, EMBED}, models - {CHAT, EMBED}
    methods = set(re.findall(r'\bmethod="([^"]*)"', text))
    assert methods <= {"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "OTHER"}
    routes = set(re.findall(r'\broute="([^"]*)"', text))
    assert all(
        route.startswith(("/v1/", "/admin/", "/health")) or route == "unmatched" for route in routes
    ), routes
    assert len(series) < 3000, len(series)  # bounded by routes, statuses and agents
