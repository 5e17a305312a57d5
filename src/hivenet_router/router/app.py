"""The public HTTP app: one edge middleware and the route allowlist.

Only these routes exist; anything else is a structured 404 that never reaches an agent.
"""

from __future__ import annotations

import asyncio
import logging
import random
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Middleware

from hivenet_router.domain.errors import ApiError, ErrorCode, error_body
from hivenet_router.router.handlers import Handlers
from hivenet_router.router.metrics import RouterMetrics

log = logging.getLogger("hivenet.api")

INFERENCE_ROUTES = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/embeddings",
    "/v1/rerank",
)

_HTTP_CODES = {
    404: ErrorCode.NOT_FOUND,
    405: ErrorCode.METHOD_NOT_ALLOWED,
    413: ErrorCode.REQUEST_TOO_LARGE,
}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def request_id(supplied: str | None) -> str:
    """Keep a client's X-Request-ID only when it is a UUID; otherwise make one.

    Request IDs correlate logs; they are not secrets, so a fast pseudo-random UUID will do
    (uuid4 costs a system call per request).
    """
    if supplied:
        try:
            return str(uuid.UUID(supplied))
        except ValueError:
            pass
    return str(uuid.UUID(int=random.getrandbits(128), version=4))


def _error_response(status: int, body: bytes, rid: str) -> web.Response:
    return web.Response(
        status=status, body=body, content_type="application/json", headers={"X-Request-ID": rid}
    )


def edge_middleware(metrics: RouterMetrics) -> Middleware:
    loop_time = asyncio.get_running_loop().time
    durations: dict[tuple[str, int], Any] = {}

    @web.middleware
    async def edge(request: web.Request, handler: Handler) -> web.StreamResponse:
        rid = request_id(request.headers.get("X-Request-ID"))
        request["request_id"] = rid
        started = loop_time()
        try:
            response = await handler(request)
        except ApiError as exc:
            response = _error_response(exc.http_status, exc.body(), rid)
        except web.HTTPException as exc:
            code = _HTTP_CODES.get(exc.status, ErrorCode.REQUEST_INVALID)
            message = (
                exc.reason if exc.status != 404 else f"no route {request.method} {request.path}"
            )
            response = _error_response(
                exc.status, error_body(code, message, status=exc.status), rid
            )
        except (asyncio.CancelledError, ConnectionError):
            raise
        except Exception:
            log.exception(
                "unhandled error on %s %s (request %s)", request.method, request.path, rid
            )
            response = _error_response(
                500,
                error_body(ErrorCode.BACKEND_ERROR, "internal router error", status=500),
                rid,
            )
        if not response.prepared:
            response.headers["X-Request-ID"] = rid
        resource = request.match_info.route.resource
        endpoint = resource.canonical if resource is not None else "unmatched"
        key = (endpoint, response.status)
        series = durations.get(key)
        if series is None:
            series = durations[key] = metrics.request_duration.labels(endpoint, str(key[1]))
        series.observe(loop_time() - started)
        return response

    return edge


def build_app(handlers: Handlers, metrics: RouterMetrics, body_limit: int) -> web.Application:
    # aiohttp's own limits bound the request line and each header (8 KiB).
    app = web.Application(middlewares=[edge_middleware(metrics)], client_max_size=body_limit)
    app.router.add_get("/health", handlers.health)
    app.router.add_get("/v1/models", handlers.models)
    app.router.add_get("/v1/models/{model:.+}", handlers.model)
    for route in INFERENCE_ROUTES:
        app.router.add_post(route, handlers.inference)
    return app
