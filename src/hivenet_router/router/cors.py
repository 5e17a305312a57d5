"""Cross-origin requests from browsers (CORS), for the origins an operator allows.

None are allowed by default, and then this costs nothing. A preflight (`OPTIONS` with
`Origin` and `Access-Control-Request-Method`) from an allowed origin is answered here,
before routing and without authentication, and is neither audited nor counted as a
request. Every other request from an allowed origin gets the headers that let the browser
read its answer, whole, streamed or an error. A preflight from any other origin is a 400.
"""

from __future__ import annotations

from hivenet_router.domain.errors import ErrorCode, error_body
from hivenet_router.http1.messages import Request, Response

METHODS = "GET, POST, PUT, DELETE, OPTIONS"
# What a browser's script may read of an answer: the request's ID and trace, when to
# retry, and what admission and the cache did (the output bound held, a cache hit, the
# rate left), which a browser hides unless named here.
EXPOSED = (
    "X-Request-ID, Retry-After, traceparent, X-Hivenet-Output-Bound, X-Hivenet-Cache, "
    "X-RateLimit-Remaining-Requests, X-RateLimit-Remaining-Tokens"
)
MAX_REQUESTED_HEADERS = 1024  # a longer Access-Control-Request-Headers is not echoed
DEFAULT_HEADERS = "authorization, content-type, x-api-key, anthropic-version, x-request-id"


class Cors:
    def __init__(self, origins: tuple[str, ...]) -> None:
        self.any = "*" in origins
        self.origins = frozenset(origins)

    def allowed(self, origin: str) -> bool:
        return self.any or origin in self.origins

    def headers(self, request: Request) -> dict[str, str]:
        """The headers an answer to `request` carries ({} when its origin is not allowed)."""
        origin = request.headers.get("origin")
        if origin is None or not self.allowed(origin):
            return {}
        return {
            "Access-Control-Allow-Origin": origin,
            "Access-Control-Expose-Headers": EXPOSED,
            "Vary": "Origin",
        }

    def preflight(self, request: Request, request_id: str) -> Response | None:
        """The answer to a preflight (with `request_id`, as every answer has one), or None
        when `request` is not one."""
        headers = request.headers
        if request.method != "OPTIONS" or "access-control-request-method" not in headers:
            return None
        origin = headers.get("origin")
        if origin is None or not self.allowed(origin):
            shown = origin[:200] if origin is not None else None  # bounded in the answer
            message = f"origin {shown!r} is not allowed"
            body = error_body(ErrorCode.REQUEST_INVALID, message, status=400, request_id=request_id)
            return Response(body, 400, headers={"Vary": "Origin", "X-Request-ID": request_id})
        asked = headers.get("access-control-request-headers", "")
        return Response(
            b"",
            204,
            headers={
                "X-Request-ID": request_id,
                "Access-Control-Allow-Origin": origin,
                "Access-Control-Allow-Methods": METHODS,
                "Access-Control-Allow-Headers": asked
                if 0 < len(asked) <= MAX_REQUESTED_HEADERS
                else DEFAULT_HEADERS,
                "Access-Control-Max-Age": "600",
                "Vary": "Origin",
            },
        )
