"""The yardstick: a bare aiohttp pass-through proxy (parse the body, forward, relay).

It does the least any Python proxy must do, so the router's CPU per request is judged
against it in the same run, on the same machine.
"""

from __future__ import annotations

import sys

import aiohttp
import orjson
import uvloop
from aiohttp import web


async def main(port: int, upstream: str) -> None:
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    async def proxy(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        orjson.loads(body)  # a real proxy reads at least the model field
        async with session.post(
            upstream + request.path, data=body, headers={"Content-Type": "application/json"}
        ) as upstream_resp:
            if not upstream_resp.content_type.startswith("text/event-stream"):
                return web.Response(
                    status=upstream_resp.status,
                    body=await upstream_resp.read(),
                    content_type=upstream_resp.content_type,
                )
            response = web.StreamResponse(status=upstream_resp.status)
            response.content_type = "text/event-stream"
            await response.prepare(request)
            async for chunk in upstream_resp.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    async def models(request: web.Request) -> web.Response:
        async with session.get(upstream + request.path) as upstream_resp:
            return web.Response(
                status=upstream_resp.status,
                body=await upstream_resp.read(),
                content_type=upstream_resp.content_type,
            )

    app = web.Application()
    app.router.add_post("/v1/chat/completions", proxy)
    app.router.add_get("/v1/models", models)  # what the benchmark polls for readiness
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port, backlog=1024).start()
    await __import__("asyncio").Event().wait()


if __name__ == "__main__":
    uvloop.run(main(int(sys.argv[1]), sys.argv[2]))
