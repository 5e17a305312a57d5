"""The agent authentication RPC: grpcio, inside TLS 1.3 with the router's pinned key.

Service `hivenet.auth.v1.AgentAuth`, unary method `Authenticate`; request and answer are
JSON documents (see docs/security.md). The TLS front on --grpc-port relays each connection
to the gRPC server on loopback and remembers which client address each relay carries, so
the failed-attempt limit applies to real sources.

Every connection there is unauthenticated (the call it carries is the authentication), and
each one relayed holds three descriptors (the client's socket and both ends of the
loopback hop). So the front counts connections per source and in all from the accept, on
the TLS gate (http1/tlsgate.py), and bounds the TLS handshake and then the call each by
`conn_timeout` seconds: an agent's call takes milliseconds, an idle connection goes.
"""

from __future__ import annotations

import asyncio
import logging
import ssl

import grpc
import orjson

from hivenet_router.http1.guard import ConnectionGuard, address_prefix
from hivenet_router.http1.tlsgate import TlsGate
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
    def __init__(
        self,
        authenticator: AgentAuthenticator,
        tls: ssl.SSLContext,
        guard: ConnectionGuard,
        conn_timeout: float = 10.0,
    ) -> None:
        self._authenticator = authenticator
        self._tls = tls
        self.guard = guard
        self._conn_timeout = conn_timeout
        self._sources: dict[int, str] = {}
        self._server: grpc.aio.Server | None = None
        self._front: asyncio.Server | None = None
        self._inner_port = 0
        self.gate: TlsGate | None = None

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
        loop = asyncio.get_running_loop()

        def streams() -> asyncio.Protocol:
            return asyncio.StreamReaderProtocol(asyncio.StreamReader(), self._accept)

        self.gate = TlsGate(self.guard, self._tls, streams, self._conn_timeout)
        self._front = await loop.create_server(self.gate, host, port, backlog=256)

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
            # The handshake had its own bound of the same length; the call gets as long
            # again (relay closes both sides when it is cancelled).
            async with asyncio.timeout(self._conn_timeout):
                await relay((reader, writer), inner)
        except TimeoutError:
            log.debug("agent auth connection from %s closed at its deadline", source)
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
