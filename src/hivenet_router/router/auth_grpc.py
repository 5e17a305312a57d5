"""The agent authentication RPC: grpcio, inside TLS 1.3 with the router's pinned key.

Service `hivenet.auth.v1.AgentAuth`, unary method `Authenticate`; request and answer are
JSON documents (see docs/security.md). The TLS front on --grpc-port relays each connection
to the gRPC server on loopback and remembers which client address each relay carries, so
the failed-attempt limit applies to real sources.
"""

from __future__ import annotations

import asyncio
import logging
import ssl

import grpc
import orjson

from hivenet_router.http1.guard import address_prefix
from hivenet_router.router.agent_auth import MAX_AUTH_BODY, AgentAuthenticator
from hivenet_router.transport.tunnel import relay

log = logging.getLogger("hivenet.grpc")

SERVICE = "hivenet.auth.v1.AgentAuth"
METHOD = "Authenticate"

_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
}


class GrpcAuthServer:
    def __init__(self, authenticator: AgentAuthenticator, tls: ssl.SSLContext) -> None:
        self._authenticator = authenticator
        self._tls = tls
        self._sources: dict[int, str] = {}
        self._server: grpc.aio.Server | None = None
        self._front: asyncio.Server | None = None
        self._inner_port = 0

    async def start(self, host: str, port: int) -> None:
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", MAX_AUTH_BODY)])
        handler = grpc.method_handlers_generic_handler(
            SERVICE,
            {METHOD: grpc.unary_unary_rpc_method_handler(self._authenticate)},
        )
        server.add_generic_rpc_handlers((handler,))
        self._inner_port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        self._server = server
        self._front = await asyncio.start_server(
            self._accept, host, port, ssl=self._tls, ssl_handshake_timeout=10.0, backlog=256
        )

    async def stop(self) -> None:
        if self._front is not None:
            self._front.close()
        if self._server is not None:
            await self._server.stop(grace=1.0)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        source = address_prefix(str(peer[0])) if peer else "unknown"
        try:
            inner = await asyncio.open_connection("127.0.0.1", self._inner_port)
        except OSError as exc:
            log.error("cannot reach the local gRPC server: %s", exc)
            writer.close()
            return
        local_port = int(inner[1].get_extra_info("sockname")[1])
        self._sources[local_port] = source
        try:
            await relay((reader, writer), inner)
        finally:
            self._sources.pop(local_port, None)

    async def _authenticate(
        self, request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]
    ) -> bytes:
        peer = context.peer()  # "ipv4:127.0.0.1:PORT", the relay's side of the loopback hop
        try:
            source = self._sources.get(int(peer.rsplit(":", 1)[1]), "unknown")
        except (IndexError, ValueError):
            source = "unknown"
        status, answer = self._authenticator.answer(request, source)
        if status != 200:
            await context.abort(
                _CODES.get(status, grpc.StatusCode.INTERNAL), str(answer.get("error", "refused"))
            )
        return orjson.dumps(answer)
