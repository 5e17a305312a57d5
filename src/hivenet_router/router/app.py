"""The public HTTP app: one edge middleware and the route allowlist.

Only these routes exist; anything else is a structured 404 that never reaches an agent.
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
from hivenet_router.router.admin import AdminApi
from hivenet_router.router.handlers import Handlers
from hivenet_router.router.metrics import RouterMetrics
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

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error_response(status: int, body: bytes, rid: str) -> web.Response:
    return web.Response(
        status=status, body=body, content_type="application/json", headers={"X-Request-ID": rid}
    )


class Edge:
    """What every public request goes through: request ID, error envelope, duration metric.

    Applied by wrapping each route's handler rather than as aiohttp middleware, which costs
    a few percent of the router's CPU per request for nothing this needs.
    """

    def __init__(self, metrics: RouterMetrics, auth: AuthState) -> None:
        self._metrics = metrics
        self._auth = auth
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
        loop_time = self._loop_time
        durations: dict[int, Any] = {}
        histogram = self._metrics.request_duration
        auth = self._auth
        inflight = self.inflight

        async def edge(request: web.Request) -> web.StreamResponse:
            task = asyncio.current_task()
            assert task is not None
            inflight.add(task)
            try:
                return await guarded(request)
            finally:
                inflight.discard(task)

        async def guarded(request: web.Request) -> web.StreamResponse:
            rid = request_id(request.headers.get("X-Request-ID"))
            request["request_id"] = rid
            limits: dict[str, str] = {}
            request["limit_headers"] = limits
            started = loop_time()
            try:
                check_headers(request)
                if guard == "client":
                    principal = auth.client.authenticate(credential(request), time.time())
                    if principal is None:
                        raise ApiError(ErrorCode.UNAUTHORIZED, "unauthorized")
                    request["principal"] = principal
                elif guard == "admin" and not auth.admin.authenticate(credential(request)):
                    raise ApiError(ErrorCode.UNAUTHORIZED, "unauthorized")
                response = await handler(request)
            except ApiError as exc:
                response = _error_response(exc.http_status, exc.body(rid), rid)
                response.headers.update(limits)
                if exc.code is ErrorCode.UNAUTHORIZED:
                    response.headers["WWW-Authenticate"] = 'Bearer realm="hivenet-router"'
            except (asyncio.CancelledError, ConnectionError):
                raise
            except Exception:
                log.exception(
                    "unhandled error on %s %s (request %s)", request.method, request.path, rid
                )
                response = _error_response(
                    500,
                    error_body(
                        ErrorCode.BACKEND_ERROR, "internal router error", status=500, request_id=rid
                    ),
                    rid,
                )
            if not response.prepared:
                response.headers["X-Request-ID"] = rid
                if request.get("close"):
                    response.force_close()
            series = durations.get(response.status)
            if series is None:
                series = durations[response.status] = histogram.labels(
                    endpoint, str(response.status)
                )
            series.observe(loop_time() - started)
            return response

        return edge


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
