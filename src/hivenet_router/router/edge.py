"""The public HTTP edge: what every public request goes through, and the route allowlist.

The edge gives a request its ID, authenticates it, makes its Ticket, turns any ApiError
into the one error envelope, and, whatever happens, tells the observers how it ended. Only
the routes listed here exist; anything else is a structured 404 that never reaches an
agent. Routes are resolved by one dictionary lookup for fixed paths, then a short list
of patterns; HEAD is answered as GET without the body.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import unquote

import orjson

from hivenet_router.auth.providers import AuthState
from hivenet_router.domain.answer import Outcome
from hivenet_router.domain.errors import ApiError, ErrorCode, code_from_str, error_body
from hivenet_router.http1.messages import Answer, App, Request, Response
from hivenet_router.observability.audit import (
    ASKED_METHOD,
    ASKED_PATH,
    METHOD_CHARS,
    PATH_CHARS,
)
from hivenet_router.observability.events import Ended, Observers
from hivenet_router.observability.tracing import Tracing
from hivenet_router.pipeline.ticket import Ticket
from hivenet_router.router.admin import AdminApi
from hivenet_router.router.cors import Cors
from hivenet_router.router.handlers import Handlers
from hivenet_router.router.requests import credential, request_id

log = logging.getLogger("hivenet.api")

INFERENCE_ROUTES = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/embeddings",
    "/v1/rerank",
)
CLIENT_GONE = 499  # the status a request that lost its client is recorded with
# Methods as metrics label them; any other token a client sends is "OTHER".
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"})

Handler = Callable[[Request], Awaitable[Answer]]


def _error_response(status: int, body: bytes, rid: str) -> Response:
    return Response(body, status, headers={"X-Request-ID": rid})


class Edge:
    def __init__(
        self,
        auth: AuthState,
        observers: Observers,
        cors: Cors | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self._auth = auth
        self._observers = observers
        self.cors = cors
        self.tracing = tracing
        self._loop_time = asyncio.get_running_loop().time
        # Requests being served: their task, with their method and route.
        self.inflight: dict[asyncio.Task[Any], tuple[str, str]] = {}

    async def drain(self, grace: float, cutting: Callable[[], None]) -> int:
        """Give the requests in flight up to `grace` seconds to finish, then call `cutting`
        and cancel the rest (a stream is cut) and wait for them to unwind. Returns how many
        were cut."""
        if self.inflight:
            await asyncio.wait(set(self.inflight), timeout=grace)
        left = set(self.inflight)
        if left:
            cutting()
        for task in left:
            task.cancel()
        if left:
            await asyncio.wait(left, timeout=2.0)
        return len(left)

    def wrap(self, endpoint: str, handler: Handler, guard: str = "") -> Handler:
        """`guard`: "client" for /v1/*, "admin" for /admin/*, "" for public routes."""
        inflight = self.inflight
        serve = self._serve

        async def edge(request: Request) -> Answer:
            task = asyncio.current_task()
            assert task is not None
            method = request.method if request.method in METHODS else "OTHER"
            inflight[task] = (method, endpoint)
            try:
                return await serve(request, endpoint, handler, guard, method)
            finally:
                del inflight[task]

        return edge

    def _authenticate(self, request: Request, ticket: Ticket, guard: str) -> None:
        auth = self._auth
        if guard == "client":
            principal = auth.client.authenticate(credential(request), time.time())
            if principal is None:
                raise ApiError(ErrorCode.UNAUTHORIZED, "unauthorized")
            ticket.principal = principal
        elif guard == "admin" and not auth.admin.authenticate(credential(request)):
            raise ApiError(ErrorCode.UNAUTHORIZED, "unauthorized")

    async def _serve(
        self, request: Request, endpoint: str, handler: Handler, guard: str, method: str
    ) -> Answer:
        rid = request_id(request.headers.get("x-request-id"))
        ticket = Ticket(rid, endpoint, self._loop_time(), self._observers)
        ticket.method = method
        ticket.source_ip = request.source
        request.ticket = ticket
        if self.cors is not None:
            ticket.headers_out.update(self.cors.headers(request))
        if endpoint.startswith("/v1/messages"):
            # Where the Anthropic SDKs look for it (`_request_id` of a message or error).
            ticket.headers_out["request-id"] = rid
        if self.tracing is not None:
            self.tracing.begin(ticket, method, request.headers.get("traceparent"))
        try:
            response = await self._answer(request, ticket, handler, guard)
        except BaseException:
            # Only the client going away (or a cut at shutdown) leaves the edge unanswered;
            # a client that left after the whole stream (its last event) was served.
            self._end(ticket, 200 if ticket.outcome is Outcome.OK else CLIENT_GONE)
            raise
        if isinstance(response, Response):
            response.headers["X-Request-ID"] = rid
            if ticket.headers_out:
                response.headers.update(ticket.headers_out)
            response.close = response.close or request.close
            if response.status >= 400 and ticket.failure is None:
                ticket.failure = received_code(response.body)
        self._end(ticket, response.status)
        return response

    async def _answer(
        self, request: Request, ticket: Ticket, handler: Handler, guard: str
    ) -> Answer:
        rid = ticket.request_id
        try:
            self._authenticate(request, ticket, guard)
            return await handler(request)
        except ApiError as exc:
            ticket.failure = exc.code
            response = _error_response(exc.http_status, exc.body(rid), rid)
            response.headers.update(ticket.headers_out)
            if exc.code is ErrorCode.UNAUTHORIZED:
                response.headers["WWW-Authenticate"] = 'Bearer realm="hivenet-router"'
            return response
        except (asyncio.CancelledError, ConnectionError):
            raise
        except Exception:
            log.exception(
                "unhandled error on %s %s (request %s)", request.method, request.path, rid
            )
            ticket.failure = ErrorCode.BACKEND_ERROR
            body = error_body(
                ErrorCode.BACKEND_ERROR, "internal router error", status=500, request_id=rid
            )
            return _error_response(500, body, rid)

    def _end(self, ticket: Ticket, status: int) -> None:
        ticket.emit(
            Ended(
                status,
                ticket.failure,
                ticket.outcome,
                ticket.usage,
                self._loop_time() - ticket.started,
            )
        )


def received_code(body: bytes) -> ErrorCode | None:
    """The code of an error answer the client gets as it came (an engine's refusal the
    agent put in the envelope, a cached or shared one): read from its body, so the audit
    record and the request log say what the client read (`context_length_exceeded`), not
    a code guessed from the status. None when the body names no code of ours."""
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    inner = parsed.get("error") if isinstance(parsed, dict) else None
    code = inner.get("code") if isinstance(inner, dict) else None
    return code_from_str(code) if isinstance(code, str) else None


_NO_ORIGINS = Cors(())


class Routes:
    """The route allowlist: fixed paths by dictionary, then patterns in order. A path known
    under another method is a 405; anything else a structured 404. Both pass the edge."""

    def __init__(self, edge: Edge) -> None:
        self._edge = edge
        self._fixed: dict[tuple[str, str], Handler] = {}
        self._patterns: list[tuple[str, re.Pattern[str], Handler]] = []
        self._methods: dict[str, set[str]] = {}
        self._unrouted = edge.wrap("unmatched", self._refuse)

    def add(self, method: str, path: str, handler: Handler, guard: str) -> None:
        wrapped = self._edge.wrap(path, handler, guard)
        if "{" not in path:
            self._fixed[(method, path)] = wrapped
            self._methods.setdefault(path, set()).add(method)
            return
        pattern = re.sub(
            r"\{(\w+)(?::([^}]+))?\}",
            lambda m: f"(?P<{m.group(1)}>{m.group(2) or '[^/]+'})",
            path,
        )
        self._patterns.append((method, re.compile(pattern + r"\Z"), wrapped))

    def _find(self, method: str, path: str) -> tuple[Handler, dict[str, str]] | None:
        handler = self._fixed.get((method, path))
        if handler is not None:
            return handler, {}
        for wanted, pattern, candidate in self._patterns:
            if wanted == method and (match := pattern.match(path)) is not None:
                found = match.groupdict()
                if "%" in path:  # a slash or percent sign in a parameter came encoded
                    found = {name: unquote(value) for name, value in found.items()}
                return candidate, found
        return None

    async def __call__(self, request: Request) -> Answer:
        if request.method == "OPTIONS":
            # With no origin allowed (the default) a preflight is refused all the same,
            # as docs/observability.md says, not routed to a 405.
            cors = self._edge.cors or _NO_ORIGINS
            rid = request_id(request.headers.get("x-request-id"))
            if (preflight := cors.preflight(request, rid)) is not None:
                return preflight
        method = "GET" if request.method == "HEAD" else request.method
        found = self._find(method, request.path)
        if found is None:
            return await self._unrouted(request)
        handler, request.match_info = found
        return await handler(request)

    async def _refuse(self, request: Request) -> Answer:
        path = request.path
        ticket = request.ticket
        if ticket is not None:  # the request log and audit record say what was asked
            ticket.note(ASKED_METHOD, request.method[:METHOD_CHARS])
            ticket.note(ASKED_PATH, path[:PATH_CHARS])
        allowed = self._methods.get(path) or {
            method for method, pattern, _ in self._patterns if pattern.match(path)
        }
        if allowed:
            if ticket is not None:  # RFC 9110: a 405 says which methods the path takes
                ticket.headers_out["Allow"] = ", ".join(sorted(allowed))
            raise ApiError(
                ErrorCode.METHOD_NOT_ALLOWED, f"{path} accepts {', '.join(sorted(allowed))} only"
            )
        hint = ""
        if not path.startswith("/v1/") and self._find(request.method, "/v1" + path) is not None:
            # A client whose base URL left out the /v1 (found by a new user).
            hint = f" (did you mean /v1{path}? a client's base URL ends in /v1)"
        raise ApiError(ErrorCode.NOT_FOUND, f"no route {request.method} {path[:PATH_CHARS]}{hint}")


def build_app(
    handlers: Handlers,
    admin: AdminApi,
    edge: Edge,
    client_routes: list[tuple[str, str, Handler]] | None = None,
    pages: list[tuple[str, str, Handler]] | None = None,
) -> App:
    """The public routes, each behind the edge with its guard; `client_routes` are more
    routes for API clients (the Responses API), `pages` routes of later layers that need
    no key (the console's static files), both wired in wiring.py."""
    routes = Routes(edge)
    for method, path, handler in pages or ():
        routes.add(method, path, handler, "")
    routes.add("GET", "/health", handlers.health, "")
    routes.add("GET", "/v1/models", handlers.models, "client")
    routes.add("GET", "/v1/models/{model:.+}", handlers.model, "client")
    for route in INFERENCE_ROUTES:
        routes.add("POST", route, handlers.inference, "client")
    for method, path, handler in client_routes or ():
        routes.add(method, path, handler, "client")
    for method, path, handler in admin.routes():
        routes.add(method, path, handler, "admin")
    return routes
