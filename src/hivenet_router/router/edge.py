"""The public HTTP edge: what every public request goes through, and the route allowlist.

The edge gives a request its ID, authenticates it, makes its Ticket, turns any ApiError
into the one error envelope, and, whatever happens, tells the observers how it ended. Only
the routes listed here exist; anything else is a structured 404 that never reaches an
agent. (Wrapping each route's handler costs less than aiohttp middleware.)
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from hivenet_router.auth.providers import AuthState
from hivenet_router.domain.errors import ApiError, ErrorCode, error_body
from hivenet_router.observability.events import Ended, Observers
from hivenet_router.pipeline.ticket import Ticket
from hivenet_router.router.admin import AdminApi
from hivenet_router.router.handlers import Handlers
from hivenet_router.router.requests import check_headers, credential, request_id

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

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error_response(status: int, body: bytes, rid: str) -> web.Response:
    return web.Response(
        status=status, body=body, content_type="application/json", headers={"X-Request-ID": rid}
    )


class Edge:
    def __init__(self, auth: AuthState, observers: Observers) -> None:
        self._auth = auth
        self._observers = observers
        self._loop_time = asyncio.get_running_loop().time
        self.inflight: set[asyncio.Task[Any]] = set()

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

        async def edge(request: web.Request) -> web.StreamResponse:
            task = asyncio.current_task()
            assert task is not None
            inflight.add(task)
            try:
                return await serve(request, endpoint, handler, guard)
            finally:
                inflight.discard(task)

        return edge

    def _authenticate(self, request: web.Request, ticket: Ticket, guard: str) -> None:
        auth = self._auth
        if guard == "client":
            principal = auth.client.authenticate(credential(request), time.time())
            if principal is None:
                raise ApiError(ErrorCode.UNAUTHORIZED, "unauthorized")
            ticket.principal = principal
        elif guard == "admin" and not auth.admin.authenticate(credential(request)):
            raise ApiError(ErrorCode.UNAUTHORIZED, "unauthorized")

    async def _serve(
        self, request: web.Request, endpoint: str, handler: Handler, guard: str
    ) -> web.StreamResponse:
        rid = request_id(request.headers.get("X-Request-ID"))
        ticket = Ticket(rid, endpoint, self._loop_time(), self._observers)
        request["ticket"] = ticket
        try:
            response = await self._answer(request, ticket, handler, guard)
        except BaseException:
            # Only the client going away (or a cut at shutdown) leaves the edge unanswered.
            self._end(ticket, CLIENT_GONE)
            raise
        if not response.prepared:
            response.headers["X-Request-ID"] = rid
            if request.get("close"):
                response.force_close()
        self._end(ticket, response.status)
        return response

    async def _answer(
        self, request: web.Request, ticket: Ticket, handler: Handler, guard: str
    ) -> web.StreamResponse:
        rid = ticket.request_id
        try:
            check_headers(request)
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


def build_app(handlers: Handlers, admin: AdminApi, edge: Edge, body_limit: int) -> web.Application:
    """The route allowlist. Anything else, any method, gets a structured 404 or 405."""
    # aiohttp's own limits bound the request line and each header (8 KiB).
    app = web.Application(client_max_size=body_limit)
    known: dict[str, str] = {}

    def add(method: str, path: str, handler: Handler, guard: str) -> None:
        app.router.add_route(method, path, edge.wrap(path, handler, guard))
        if "{" not in path:
            known[path] = method

    add("GET", "/health", handlers.health, "")
    add("GET", "/v1/models", handlers.models, "client")
    add("GET", "/v1/models/{model:.+}", handlers.model, "client")
    for route in INFERENCE_ROUTES:
        add("POST", route, handlers.inference, "client")
    for method, path, handler in admin.routes():
        add(method, path, handler, "admin")

    async def unrouted(request: web.Request) -> web.StreamResponse:
        allowed = known.get(request.path)
        if allowed is not None or request.path.startswith("/v1/models/"):
            allowed = allowed or "GET"
            raise ApiError(ErrorCode.METHOD_NOT_ALLOWED, f"{request.path} accepts {allowed} only")
        raise ApiError(ErrorCode.NOT_FOUND, f"no route {request.method} {request.path}")

    app.router.add_route("*", "/{tail:.*}", edge.wrap("unmatched", unrouted))
    return app
