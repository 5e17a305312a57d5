"""Generated inputs, valid and invalid, from the official specs against every public route.

schemathesis draws requests from the OpenAI and Anthropic documents (half of them with the
`model` swapped for one the router serves, so they reach an agent). The router must answer
each with a non-5xx status inside the timeout, and afterwards hold no forwarding slot, agent
slot, queue entry or token reservation. The number of examples is bounded: FUZZ_EXAMPLES
(default 15 per route and mode, 255 requests, 35 to 42 s here) keeps the CI run short;
raise it for a longer run.
"""

from __future__ import annotations

import os
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
    ("anthropic", "/v1/messages", "POST"),
    ("anthropic", "/v1/messages/count_tokens", "POST"),
    ("anthropic", "/v1/models", "GET"),
    ("anthropic", "/v1/models/{model_id}", "GET"),
]


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Router]:
    tmp: Path = tmp_path_factory.mktemp("fuzz")
    with cluster(tmp) as c:
        r = c.router()
        chat = c.sim(CHAT, "--zero-latency", "--output-tokens", "8", name="sim-chat")
        embed = c.sim(EMBED, "--zero-latency", name="sim-embed")
        c.agent(r, chat, name="agent-chat")
        c.agent(r, embed, "--capability", "embedding", name="agent-embed")
        wait_registered(r, CHAT)
        wait_registered(r, EMBED)
        yield r


def _aim(case: Case, model: str) -> None:
    """Point a generated body at a served model so the request gets past the model lookup."""
    if isinstance(case.body, dict):
        case.body["model"] = model
        if isinstance(case.body.get("max_tokens"), int):
            case.body["max_tokens"] = min(case.body["max_tokens"], 64)


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

    one()
    assert statuses

    def drained() -> bool:
        text = router.metrics()
        held = [
            metric(text, name)
            for name in (
                "hivenet_router_active_forwards",
                "hivenet_router_pending_requests",
                "hivenet_agent_capacity_utilization",
                "hivenet_queue_depth",
                "hivenet_admission_occupancy_tokens",
                "hivenet_admission_inflight_requests",
            )
        ]
        return not any(held)

    wait_until(drained, timeout=5)
