"""Just enough ZMTP 3.0 (ZeroMQ's wire protocol, rfc.zeromq.org/spec/23) to publish and to
subscribe to vLLM's KV-cache events without libzmq: the NULL mechanism, PUB and SUB
sockets, one TCP connection each way.

A connection opens with a 64-byte greeting each way (signature, version 3.0, mechanism
NULL), then a READY command naming the socket type. After that every message is one or
more frames: a flags byte (MORE 0x01, LONG 0x02, COMMAND 0x04), a size (one byte, or
eight big-endian with LONG) and the body. A ZMTP 3.0 subscriber subscribes by sending
the message `0x01 + topic prefix`; the publisher sends a subscriber the messages whose
first frame starts with one of its prefixes. vLLM publishes each batch of KV-cache events
as three frames: the topic, an 8-byte big-endian sequence number, and the msgpack batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
from collections.abc import Sequence

log = logging.getLogger("hivenet.zmtp")

MORE, LONG, COMMAND = 0x01, 0x02, 0x04
MAX_MESSAGE = 16 * 1024 * 1024  # the longest frame this side accepts


class ZmtpError(Exception):
    pass


def greeting(as_server: bool = False) -> bytes:
    mechanism = b"NULL".ljust(20, b"\x00")
    return b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + mechanism + bytes([as_server]) + bytes(31)


def ready(socket_type: str) -> bytes:
    name = b"Socket-Type"
    value = socket_type.encode()
    body = b"\x05READY" + bytes([len(name)]) + name + struct.pack(">I", len(value)) + value
    return _frame(body, COMMAND)


def _frame(body: bytes, flags: int = 0) -> bytes:
    if len(body) > 255:
        return bytes([flags | LONG]) + struct.pack(">Q", len(body)) + body
    return bytes([flags, len(body)]) + body


def message(frames: Sequence[bytes]) -> bytes:
    last = len(frames) - 1
    return b"".join(_frame(f, 0 if i == last else MORE) for i, f in enumerate(frames))


async def _handshake(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, kind: str) -> None:
    writer.write(greeting(kind == "PUB"))
    writer.write(ready(kind))
    await writer.drain()
    theirs = await reader.readexactly(64)
    if theirs[0] != 0xFF or theirs[9] != 0x7F or theirs[10] < 3:
        raise ZmtpError("not a ZMTP 3 peer")
    if theirs[12:16] != b"NULL":
        raise ZmtpError("only the NULL mechanism is spoken here")
    flags, body = await _read_frame(reader)
    if not flags & COMMAND or not body.startswith(b"\x05READY"):
        raise ZmtpError("expected READY")


async def _read_frame(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    flags = (await reader.readexactly(1))[0]
    if flags & LONG:
        (size,) = struct.unpack(">Q", await reader.readexactly(8))
    else:
        size = (await reader.readexactly(1))[0]
    if size > MAX_MESSAGE:
        raise ZmtpError(f"frame of {size} bytes")
    return flags, await reader.readexactly(size)


async def read_message(reader: asyncio.StreamReader) -> list[bytes]:
    """The next message's frames (commands, such as PINGs, are skipped)."""
    frames: list[bytes] = []
    while True:
        flags, body = await _read_frame(reader)
        if flags & COMMAND:
            continue
        frames.append(body)
        if not flags & MORE:
            return frames


class Publisher:
    """A PUB socket bound to a TCP port: every connected subscriber gets the messages it
    subscribed to; a slow one loses messages rather than hold the others back."""

    def __init__(self) -> None:
        self._server: asyncio.Server | None = None
        self._subscribers: dict[asyncio.StreamWriter, list[bytes]] = {}

    async def start(self, host: str, port: int) -> None:
        self._server = await asyncio.start_server(self._accept, host, port)

    @property
    def subscribers(self) -> int:
        return len(self._subscribers)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        topics: list[bytes] = []
        try:
            await _handshake(reader, writer, "PUB")
            self._subscribers[writer] = topics
            while True:
                frames = await read_message(reader)
                body = frames[0] if frames else b""
                if body[:1] == b"\x01":
                    topics.append(body[1:])
                elif body[:1] == b"\x00" and body[1:] in topics:
                    topics.remove(body[1:])
        except (ZmtpError, OSError, asyncio.IncompleteReadError) as exc:
            log.debug("subscriber left: %s", exc)
        finally:
            self._subscribers.pop(writer, None)
            writer.close()

    def publish(self, frames: Sequence[bytes]) -> None:
        data = message(frames)
        topic = frames[0]
        for writer, topics in list(self._subscribers.items()):
            if not any(topic.startswith(t) for t in topics):
                continue
            transport = writer.transport
            if transport.get_write_buffer_size() > MAX_MESSAGE:
                continue  # a subscriber that does not read loses messages
            writer.write(data)

    async def close(self) -> None:
        for writer in list(self._subscribers):
            writer.close()
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()


async def subscribe(
    host: str, port: int, topic: bytes = b""
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A SUB connection to a publisher, subscribed to `topic` (a prefix; empty: all)."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        await _handshake(reader, writer, "SUB")
        writer.write(message([b"\x01" + topic]))
        await writer.drain()
    except BaseException:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()
        raise
    return reader, writer
