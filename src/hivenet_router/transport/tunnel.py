"""Carry gRPC inside TLS 1.3 pinned to an Ed25519 key.

gRPC's own TLS (BoringSSL as grpcio configures it) offers no Ed25519 signature scheme, so it
cannot present or verify the key both sides derive from the shared secret. The
authentication RPC therefore runs as plaintext HTTP/2 inside a TLS 1.3 connection made by
Python's ssl module, which does: the router terminates TLS on --grpc-port and relays bytes
to its gRPC server on loopback; the agent relays its gRPC channel through a one-shot local
listener into a pinned TLS connection.
"""

from __future__ import annotations

import asyncio
import contextlib

CHUNK = 64 * 1024
IDLE_TIMEOUT = 30.0


async def _copy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            async with asyncio.timeout(IDLE_TIMEOUT):
                data = await reader.read(CHUNK)
            if not data:
                break
            writer.write(data)
            await writer.drain()
    except (ConnectionError, TimeoutError, OSError):
        pass
    finally:
        with contextlib.suppress(Exception):
            if writer.can_write_eof():
                writer.write_eof()


async def relay(
    a: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    b: tuple[asyncio.StreamReader, asyncio.StreamWriter],
) -> None:
    """Copy bytes both ways until both directions end (or idle out); then close both.

    Relays run as the connection callbacks of asyncio servers; when the process shuts down
    they are cancelled, which ends them quietly (asyncio would otherwise log the
    cancellation of a server callback as an error).
    """
    try:
        await asyncio.gather(_copy(a[0], b[1]), _copy(b[0], a[1]))
    except asyncio.CancelledError:
        pass
    finally:
        for _, writer in (a, b):
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
