from __future__ import annotations

import dataclasses

import pytest

from hivenet_router.auth.providers import ANONYMOUS
from hivenet_router.domain.answer import Answer, Whole
from hivenet_router.domain.errors import ApiError, ErrorCode
from hivenet_router.http1.messages import Request, Response
from hivenet_router.observability.events import Observers
from hivenet_router.pipeline.stage import Next, build
from hivenet_router.pipeline.ticket import Ticket
from hivenet_router.policy.document import BUILT_IN, Policy
from hivenet_router.router.handlers import MAX_FORWARDED_HEADERS, Handlers, forward_headers
from hivenet_router.router.registry import Registry


def _request(headers: list[tuple[str, str]]) -> Request:
    return Request(None, "POST", "/v1/chat/completions", "", headers, body=b"{}")


def test_forwarded_headers_leave_out_hop_by_hop_and_credentials() -> None:
    request = _request(
        [("host", "r"), ("authorization", "Bearer k"), ("x-request-id", "x"), ("x-a", "1")]
    )
    assert forward_headers(request, "rid") == [("x-a", "1"), ("x-request-id", "rid")]


def test_as_many_headers_as_an_engine_takes_are_forwarded() -> None:
    # The request's own ID is one of them; what is never forwarded does not count.
    mine = [(f"x-h{n}", "v") for n in range(MAX_FORWARDED_HEADERS - 1)]
    dropped = [("host", "r"), ("content-length", "2"), ("authorization", "Bearer k")]
    assert len(forward_headers(_request(dropped + mine), "rid")) == MAX_FORWARDED_HEADERS


def test_more_headers_than_an_engine_takes_are_the_clients_error() -> None:
    mine = [(f"x-h{n}", "v") for n in range(MAX_FORWARDED_HEADERS)]
    with pytest.raises(ApiError) as raised:
        forward_headers(_request(mine), "rid")
    assert raised.value.code is ErrorCode.REQUEST_TOO_LARGE
    assert raised.value.http_status == 431
    assert f"at most {MAX_FORWARDED_HEADERS}" in raised.value.message


async def test_the_models_policy_is_resolved_once_and_every_stage_reads_that_snapshot() -> None:
    before = dataclasses.replace(BUILT_IN, name="before")
    after = dataclasses.replace(BUILT_IN, name="after")
    current = [before]
    looked_up: list[str] = []
    seen: list[str] = []

    def policy_for(model: str) -> Policy:
        looked_up.append(model)
        return current[0]

    class Reader:
        async def __call__(self, ticket: Ticket, next: Next) -> Answer:
            seen.append(ticket.policy.name)
            current[0] = after  # a reload while the request is on its way
            return await next(ticket)

    async def terminal(ticket: Ticket) -> Answer:
        seen.append(ticket.policy.name)
        return Answer(200, [], Whole(), body=b"{}")

    async def relay(
        request: Request, ticket: Ticket, answer: Answer, shape: object = None
    ) -> Response:
        return Response(answer.body or b"")

    handlers = Handlers(
        build([Reader(), Reader()], terminal),
        relay,  # type: ignore[arg-type]
        Registry(),
        lambda model: True,
        30.0,
        policy_for=policy_for,
    )
    body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
    request = Request(None, "POST", "/v1/chat/completions", "", [], body=body)
    request.ticket = Ticket("rid", "/v1/chat/completions", 0.0, Observers())
    request.ticket.principal = ANONYMOUS
    await handlers.inference(request)
    assert looked_up == ["m"] and seen == ["before", "before", "before"]
