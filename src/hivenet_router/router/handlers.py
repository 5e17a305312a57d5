"""One function per public route. Thin: parse, run the pipeline, hand the answer to relay."""

from __future__ import annotations

import logging
from collections.abc import Callable

import orjson

from hivenet_router.domain.agent import PREFIX_HEADER, ROUTE_CAPABILITY
from hivenet_router.domain.errors import ApiError, ErrorCode
from hivenet_router.domain.request import Job
from hivenet_router.http1.messages import Answer, Request, Response
from hivenet_router.observability.events import Refused
from hivenet_router.pipeline.stage import Next
from hivenet_router.pipeline.ticket import Ticket
from hivenet_router.policy.document import Policy
from hivenet_router.router import catalog
from hivenet_router.router.bodies import model_of
from hivenet_router.router.body_reader import BodyReader
from hivenet_router.router.registry import Registry
from hivenet_router.router.relay import Relay, Shape
from hivenet_router.router.requests import read_body

log = logging.getLogger("hivenet.api")

# Never forwarded: hop-by-hop headers, and the client's router credentials, which agents and
# backends have no use for (the Go router forwards Authorization; this one does not).
_DROP = frozenset(
    {
        "host",
        "content-length",
        "connection",
        "keep-alive",
        "transfer-encoding",
        "te",
        "trailer",
        "upgrade",
        "proxy-authorization",
        "authorization",
        "x-api-key",
        "cookie",
        # The body goes on decoded (the router had to read it), so its encoding label and
        # a 100-continue expectation (answered here) describe nothing the agent receives.
        "content-encoding",
        "expect",
        # The router reads the answer's usage and never decodes a compressed body, so an
        # engine must not be invited to compress it.
        "accept-encoding",
        # Replaced by the request's own ID (the client's when it is a UUID).
        "x-request-id",
        # The router's own word to the agent on the prompt's prefix blocks: a client's
        # would paint a false picture of the engine's cache for every router.
        PREFIX_HEADER,
    }
)


# Engines refuse a request with many header lines: llama.cpp's server (cpp-httplib) takes
# 100, aiohttp (the simulator) 128. On the way the agent adds up to four (Host,
# Content-Length, its backend key, a traceparent), so a request that would forward more
# than this is the client's error here rather than the engine's there.
MAX_FORWARDED_HEADERS = 90


def forward_headers(request: Request, request_id: str) -> list[tuple[str, str]]:
    """The headers an agent gets: the client's (trailers included), less the dropped ones,
    and the request's ID. Raises ApiError (431) past MAX_FORWARDED_HEADERS."""
    headers = [(k, v) for k, v in request.headers.items() if k not in _DROP]
    headers.append(("x-request-id", request_id))
    if len(headers) > MAX_FORWARDED_HEADERS:
        raise ApiError(
            ErrorCode.REQUEST_TOO_LARGE,
            f"too many headers: {len(headers)} would reach the model's engine, which takes "
            f"at most {MAX_FORWARDED_HEADERS} (hop-by-hop headers, credentials and cookies "
            "are not counted)",
            status=431,
        )
    return headers


class Handlers:
    def __init__(
        self,
        pipeline: Next,
        relay: Relay,
        registry: Registry,
        claims: Callable[[str], bool],
        request_timeout: float,
        body_timeout: float = 30.0,
        max_stream_duration: float = 0.0,
        warming: Callable[[], bool] = lambda: False,
        reader: BodyReader | None = None,
        *,
        policy_for: Callable[[str], Policy],
    ) -> None:
        self.pipeline = pipeline
        self.policy_for = policy_for  # the policy in force now for a model
        self.reader = reader or BodyReader()
        self.relay = relay
        self.registry = registry
        self.claims = claims  # does a per-model policy name this model?
        self.request_timeout = request_timeout
        # A stream's whole life, from the request's arrival; never shorter than the deadline.
        self.max_stream_duration = max(max_stream_duration, request_timeout)
        self.body_timeout = body_timeout
        self.warming = warming

    async def health(self, request: Request) -> Answer:
        return Response(b'{"status":"ok"}')

    # -- model discovery ------------------------------------------------------------------------

    def _model_object(self, model: str, detail: bool = False) -> dict[str, object] | None:
        agents = self.registry.for_model(model)
        if not agents:
            return None
        return catalog.model_object(model, agents, detail=detail)

    async def models(self, request: Request) -> Answer:
        principal = request.ticket.caller
        data = [
            obj
            for model in sorted(self.registry.models())
            if principal.sees(model) and (obj := self._model_object(model)) is not None
        ]
        if catalog.wants_anthropic(request.headers):
            page = catalog.anthropic_page(data, request.query)
            return Response(orjson.dumps(page))
        return Response(orjson.dumps({"object": "list", "data": data}))

    async def model(self, request: Request) -> Answer:
        model = request.match_info["model"]
        principal = request.ticket.caller
        obj = self._model_object(model, detail=True) if principal.sees(model) else None
        if obj is None:
            raise ApiError(ErrorCode.MODEL_NOT_FOUND, f"model {model} is not registered")
        if catalog.wants_anthropic(request.headers):
            obj = catalog.anthropic_model(obj)
        return Response(orjson.dumps(obj))

    # -- inference ------------------------------------------------------------------------------

    def refused_body(self, ticket: Ticket, route: str, body: bytes) -> None:
        """A body refused as invalid still names its model for the audit record and the
        request log, and, when the router serves that model to this caller, counts in the
        tenant's failed requests as any other refusal does (the job is never sent)."""
        model = model_of(body)
        ticket.asked_model = model
        served = bool(model) and (bool(self.registry.for_model(model)) or self.claims(model))
        if served and ticket.caller.allows(model):
            capability = ROUTE_CAPABILITY.get(route, "")
            ticket.job = Job(route, model, capability, False, body, [])

    async def inference(self, request: Request) -> Answer:
        body = await read_body(request, self.body_timeout)
        return await self.run(request, request.path, body)

    async def run(
        self, request: Request, route: str, body: bytes, shape: Shape | None = None
    ) -> Answer:
        """Serve `body` as a request for `route` (what the agent is sent; the ticket's
        endpoint, which metrics label, stays the route the client called), its answer
        rewritten by `shape` when one is given."""
        ticket: Ticket = request.ticket
        headers = forward_headers(request, ticket.request_id)  # after the body: its trailers
        principal = ticket.caller
        try:
            facts = await self.reader.parse(route, body, principal.tenant)
        except ApiError:
            self.refused_body(ticket, route, body)
            raise
        ticket.facts = facts  # the model is known from here on (audit records name it)
        model = facts.model
        allowed = principal.allows(model)
        declared = principal.declares(model)
        known = bool(self.registry.for_model(model)) or self.claims(model)
        if known:
            # A refusal below still counts in the tenant's failed requests when the model
            # is one the router knows; a made-up name creates no metric series.
            ticket.job = Job(
                route,
                model,
                facts.capability,
                facts.stream,
                body,
                headers,
            )
        if not allowed:
            raise ApiError(
                ErrorCode.MODEL_FORBIDDEN,
                f"your API key does not have access to model: {model}",
            )
        if not declared:
            # Before every stage: a key with per-model quotas may use only the models they
            # list, and a cached or shared answer (the cache stage runs before admission)
            # must not get round that. The same 429 admission gave, whether or not the
            # model is served, so the answer does not tell which models exist; only a
            # known model is counted (by name) as a refusal.
            if known:
                ticket.emit(Refused("b4_rpm", ErrorCode.RATE_LIMIT_EXCEEDED))
            raise ApiError(
                ErrorCode.RATE_LIMIT_EXCEEDED,
                f"no quota declared for model {model} on this API key",
            )
        if not known:
            # Refused before admission and metrics: a made-up model name must not create
            # occupancy pools or metric series.
            raise self._unknown(ticket, model)
        ticket.deadline = ticket.started + self.request_timeout
        ticket.stream_end = ticket.started + self.max_stream_duration
        # Once for the whole request: every stage and dispatch read this snapshot, whatever
        # a reload does meanwhile.
        ticket.policy = self.policy_for(model)
        answer = await self.pipeline(ticket)
        return await self.relay(request, ticket, answer, shape)

    def _unknown(self, ticket: Ticket, model: str) -> ApiError:
        if self.warming():
            # Just started: the agents serving it may still be reconnecting. A 503 with
            # Retry-After is what SDKs retry; a 404 would end the client's request.
            ticket.headers_out["Retry-After"] = "1"
            return ApiError(
                ErrorCode.NO_AGENTS_AVAILABLE,
                f"router is starting and no agent for model {model} has registered yet; "
                "retry shortly",
            )
        return ApiError(ErrorCode.MODEL_NOT_FOUND, f"No agents registered for model {model}")
