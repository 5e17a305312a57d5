"""The console's static files, served on the public port under /console/.

The files are package data, read once at start. Every answer carries a Content-Security-
Policy that allows only this origin's script and style (no inline script or style, no
framing, no other origin to connect to), and `nosniff`. The assets hold no secret: the
page asks for the administrator key and sends it only to /admin/* on this origin.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from importlib import resources

from hivenet_router.http1.messages import Answer, Request, Response

Handler = Callable[[Request], Awaitable[Answer]]

PREFIX = "/console/"
TYPES = {
    ".html": "text/html; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".svg": "image/svg+xml",
}
POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
SECURITY = {
    "Content-Security-Policy": POLICY,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def _load() -> dict[str, tuple[bytes, str]]:
    files: dict[str, tuple[bytes, str]] = {}
    for entry in resources.files(__package__).joinpath("static").iterdir():
        name = entry.name
        kind = TYPES.get(name[name.rfind(".") :]) if "." in name else None
        if kind is not None and entry.is_file():
            files[name] = (entry.read_bytes(), kind)
    return files


class ConsoleAssets:
    """GET /console (a redirect), /console/ (the page) and /console/{file}."""

    def __init__(self) -> None:
        self.files = _load()

    def routes(self) -> list[tuple[str, str, Handler]]:
        return [
            ("GET", "/console", self.redirect),
            ("GET", PREFIX, self.index),
            ("GET", PREFIX + "{name:[A-Za-z0-9_.-]+}", self.asset),
        ]

    def _serve(self, name: str) -> Response:
        found = self.files.get(name)
        if found is None:
            body = b'{"error": "no such console file"}'
            return Response(body, 404, headers=dict(SECURITY))
        body, kind = found
        return Response(body, 200, content_type=kind, headers=SECURITY)

    async def redirect(self, request: Request) -> Answer:
        return Response(b"", 308, content_type=None, headers={"Location": PREFIX, **SECURITY})

    async def index(self, request: Request) -> Answer:
        return self._serve("index.html")

    async def asset(self, request: Request) -> Answer:
        return self._serve(request.match_info["name"])
