"""One function per public route. Thin: parse, hand to dispatch, relay the answer."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import orjson
from aiohttp import web

from hivenet_router.auth.providers import Principal
from hivenet_router.domain.errors import ApiError, ErrorCode, error_body
from hivenet_router.router import bodies, catalog
from hivenet_router.router.admission import Admission, Admitted
from hivenet_router.router.dispatch import Dispatcher, Exchange, Job, Progress
from hivenet_router.router.metrics import RouterMetrics
from hivenet_router.router.registry import Registry
from hivenet_router.router.requests import read_body
from hivenet_router.router.usage import StreamMeter, Usage, from_body, stream_input_tokens
from hivenet_router.transport.link import StreamReset

log = logging.getLogger("hivenet.api")

_JSON = "application/json"
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
    }
)

_TIMEOUT_MESSAGES = {
    "queue": "Request expired in queue",
    "agent": "Request timed out waiting for an available agent",
    "forward": "Request deadline exceeded while contacting agent",
    "respond": "Request timeout",
}


def _forward_headers(request: web.Request) -> list[tuple[str, str]]:
    headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _DROP]
    headers.append(("x-request-id", request["request_id"]))
    return headers


class Handlers:
    def __init__(
        self,
        dispatcher: Dispatcher,
        registry: Registry,
        metrics: RouterMetrics,
        request_timeout: float,
        admission: Admission,
        body_timeout: float = 30.0,
        warming: Callable[[], bool] = lambda: False,
    ) -> None:
        self.warming = warming
        self.stopping = False  # set when the shutdown grace is over and streams are cut
        self.body_timeout = body_timeout
        self.admission = admission
        self.dispatcher = dispatcher
        self.registry = registry
        self.metrics = metrics
        self.request_timeout = request_timeout

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(body=b'{"status":"ok"}', content_type=_JSON)

    # -- model discovery ------------------------------------------------------------------------

    def _model_object(self, model: str) -> dict[str, object] | None:
        agents = self.registry.for_model(model)
        if not agents:
            return None
        first = min(agents, key=lambda a: a.registered_at)
        return {
            "id": model,
            "object": "model",
            "created": int(first.registered_at),
            "owned_by": "hivenet-router",
            "capabilities": sorted({a.reg.capability for a in agents}),
            "healthy_replicas": sum(1 for a in agents if a.eligible),
            "hide_llm": any(a.reg.hide_llm for a in agents),
            "pretty_name": first.reg.llm_pretty_name or None,
            "info": first.reg.llm_info or None,
        }

    async def models(self, request: web.Request) -> web.Response:
        principal: Principal = request["principal"]
        data = [
            obj
            for model in sorted(self.registry.models())
            if principal.sees(model) and (obj := self._model_object(model)) is not None
        ]
        if catalog.wants_anthropic(request.headers):
            page = catalog.anthropic_page(data, request.query)
            return web.Response(body=orjson.dumps(page), content_type=_JSON)
        return web.Response(body=orjson.dumps({"object": "list", "data": data}), content_type=_JSON)

    async def model(self, request: web.Request) -> web.Response:
        model = request.match_info["model"]
        principal: Principal = request["principal"]
        obj = self._model_object(model) if principal.sees(model) else None
        if obj is None:
            raise ApiError(ErrorCode.MODEL_NOT_FOUND, f"model {model} is not registered")
        if catalog.wants_anthropic(request.headers):
            obj = catalog.anthropic_model(obj)
        return web.Response(body=orjson.dumps(obj), content_type=_JSON)

    # -- inference ------------------------------------------------------------------------------

    async def inference(self, request: web.Request) -> web.StreamResponse:
        route = request.path
        body = await read_body(request, self.body_timeout)
        facts = bodies.parse(route, body)
        principal: Principal = request["principal"]
        if not principal.allows(facts.model):
            raise ApiError(
                ErrorCode.MODEL_FORBIDDEN,
                f"your API key does not have access to model: {facts.model}",
            )
        if not self.registry.for_model(facts.model) and not self.dispatcher.claims(facts.model):
            # Refused before admission and metrics: a made-up model name must not create
            # occupancy pools or metric series.
            if self.warming():
                # Just started: the agents serving it may still be reconnecting. A 503 with
                # Retry-After is what SDKs retry; a 404 would end the client's request.
                request["limit_headers"]["Retry-After"] = "1"
                raise ApiError(
                    ErrorCode.NO_AGENTS_AVAILABLE,
                    f"router is starting and no agent for model {facts.model} has "
                    "registered yet; retry shortly",
                )
            raise ApiError(
                ErrorCode.MODEL_NOT_FOUND, f"No agents registered for model {facts.model}"
            )
        limits: dict[str, str] = request["limit_headers"]
        try:
            admitted = await self.admission.admit(principal, facts, limits)
        except ApiError as exc:
            self.refused(principal, facts.model, exc.code)
            raise
        answered = False
        job = Job(
            route,
            facts.model,
            facts.capability,
            facts.stream,
            body,
            _forward_headers(request),
            (lambda: self.admission.leave(admitted)) if admitted is not None else (lambda: None),
        )
        progress = Progress()
        deadline = asyncio.get_running_loop().time() + self.request_timeout
        usage: Usage | None = None
        try:
            async with self.dispatcher.exchange(job, progress, deadline) as exchange:
                answered = exchange.status < 400  # an error answer generated nothing
                if exchange.body is not None:
                    response, usage = self._buffered(exchange, job, limits)
                    return response
                stream_response, usage = await self._relay(
                    request, exchange, job, deadline, limits, admitted
                )
                return stream_response
        except TimeoutError:
            raise ApiError(
                ErrorCode.REQUEST_TIMEOUT, _TIMEOUT_MESSAGES.get(progress.phase, "Request timeout")
            ) from None
        except ApiError as exc:
            self.metrics.failed.labels(job.model, exc.code.value).inc()
            raise
        finally:
            if admitted is not None:
                self.admission.settle(admitted, usage, answered)
            self._tenant(principal, job.model, answered, usage)

    def _buffered(
        self, exchange: Exchange, job: Job, limits: dict[str, str]
    ) -> tuple[web.Response, Usage | None]:
        body = exchange.body or b""
        exchange.ok = exchange.status < 400
        usage = from_body(body) if exchange.ok else None
        self._account(exchange, usage)
        content_type = _header(exchange.headers, "content-type") or _JSON
        response = web.Response(
            status=exchange.status, body=body, headers={"Content-Type": content_type, **limits}
        )
        return response, usage

    async def _relay(
        self,
        request: web.Request,
        exchange: Exchange,
        job: Job,
        deadline: float,
        limits: dict[str, str],
        admitted: Admitted | None,
    ) -> tuple[web.StreamResponse, Usage | None]:
        response = web.StreamResponse(status=exchange.status, headers=limits)
        response.headers["Content-Type"] = (
            _header(exchange.headers, "content-type") or "text/event-stream"
        )
        response.headers["Cache-Control"] = "no-cache"
        response.headers["X-Request-ID"] = request["request_id"]
        await response.prepare(request)
        meter = StreamMeter()
        chunk = exchange.first
        try:
            async with asyncio.timeout_at(deadline):
                if admitted is not None and chunk is not None:
                    exact = stream_input_tokens(chunk)
                    if exact is not None:
                        admitted.exact_input(exact)
                grow = admitted.grow if admitted is not None and admitted.grows else None
                while chunk is not None:
                    meter.feed(chunk)
                    if grow is not None:
                        # about one token per SSE event: enough to keep occupancy honest
                        grow(chunk.count(b"data:"))
                    await response.write(chunk)
                    chunk = await exchange.stream.read()
            exchange.ok = True
        except StreamReset as exc:
            source = exchange.agent.peer_id if exchange.agent else exchange.provider
            log.warning("stream from %s broke: %s", source, exc)
            if exc.code == "connection_lost":
                code, why = ErrorCode.AGENT_DISCONNECTED, "the agent's connection was lost"
            else:
                code, why = ErrorCode.BACKEND_ERROR, "the engine stopped answering mid-stream"
            await self._stream_error(response, job, code, f"stream interrupted: {why}")
        except TimeoutError:
            await self._stream_error(
                response,
                job,
                ErrorCode.REQUEST_TIMEOUT,
                "request deadline expired during the stream",
            )
        except asyncio.CancelledError:
            if self.stopping:
                # Cut at the end of the shutdown grace: say so, so the client's SDK raises
                # instead of taking a truncated answer for a whole one.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(1.0):
                        await self._stream_error(
                            response,
                            job,
                            ErrorCode.AGENT_DISCONNECTED,
                            "stream interrupted: the router is shutting down",
                        )
            raise
        usage = meter.result()
        self._account(exchange, usage)
        await response.write_eof()
        return response, usage

    async def _stream_error(
        self, response: web.StreamResponse, job: Job, code: ErrorCode, message: str
    ) -> None:
        """End a broken stream with one error event: the envelope every error has, as an
        Anthropic `event: error` on /v1/messages and as a bare `data:` line elsewhere."""
        self.metrics.failed.labels(job.model, code.value).inc()
        rid = response.headers.get("X-Request-ID")
        data = b"data: " + error_body(code, message, request_id=rid) + b"\n\n"
        if job.route.startswith("/v1/messages"):
            data = b"event: error\n" + data
        with contextlib.suppress(ConnectionError):
            await response.write(data)

    def _tenant(
        self, principal: Principal, model: str, answered: bool, usage: Usage | None
    ) -> None:
        labels = (principal.tenant, principal.key_id or "anonymous", model)
        m = self.metrics
        (m.tenant_success if answered else m.tenant_failed).labels(*labels).inc()
        if usage is not None:
            m.tenant_input.labels(*labels).inc(usage.input_tokens)
            m.tenant_output.labels(*labels).inc(usage.output_tokens)

    def refused(self, principal: Principal, model: str, code: ErrorCode) -> None:
        """Count an admission refusal against the tenant."""
        labels = (principal.tenant, principal.key_id or "anonymous", model)
        if code is ErrorCode.RATE_LIMIT_EXCEEDED:
            self.metrics.tenant_rate_limited.labels(*labels).inc()
        elif code is ErrorCode.TOKEN_LIMIT_EXCEEDED:
            self.metrics.tenant_token_limited.labels(*labels).inc()

    def _account(self, exchange: Exchange, usage: Usage | None) -> None:
        if usage is None or exchange.agent is None:
            return
        agent = exchange.agent
        agent.input_tokens += usage.input_tokens
        agent.output_tokens += usage.output_tokens
        agent.meters.input_tokens.inc(usage.input_tokens)
        agent.meters.output_tokens.inc(usage.output_tokens)


def _header(headers: list[tuple[str, str]], name: str) -> str | None:
    for key, value in headers:
        if key.lower() == name:
            return value
    return None
