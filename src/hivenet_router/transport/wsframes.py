"""The WebSocket frame codec (RFC 6455), shared by both ends of the agent link.

Only what the link uses: binary messages (fragments reassembled, each message bounded),
ping, pong and close. Text messages, extensions (reserved bits) and unknown opcodes are
protocol errors. Frames from a client are masked and frames from a server are not; a frame
of the wrong kind is a protocol error too.
"""

from __future__ import annotations

import base64
import hashlib
import struct
from dataclasses import dataclass

from hivenet_router.transport.wsmask import KEYS, xor

# Message kinds, with the values aiohttp's WSMsgType uses, so that the link reads both.
BINARY = 2
CLOSE = 8
CLOSED = 257
ERROR = 258

OP_CONTINUATION, OP_TEXT, OP_BINARY = 0x0, 0x1, 0x2
OP_CLOSE, OP_PING, OP_PONG = 0x8, 0x9, 0xA

# Close codes: normal, protocol error, message too big, unexpected condition.
CLOSE_NORMAL, CLOSE_PROTOCOL_ERROR, CLOSE_TOO_BIG, CLOSE_INTERNAL = 1000, 1002, 1009, 1011

SHORT = struct.Struct("!H")
_LONG = struct.Struct("!Q")
_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


@dataclass(frozen=True, slots=True)
class Message:
    type: int
    data: object = None  # bytes for BINARY, the close code for CLOSE, a reason for ERROR


class ProtocolError(Exception):
    """The peer broke RFC 6455 (or the link's subset of it); `code` is the close code."""

    def __init__(self, message: str, code: int = CLOSE_PROTOCOL_ERROR) -> None:
        super().__init__(message)
        self.code = code


def accept_key(key: str) -> str:
    """The Sec-WebSocket-Accept value that answers a Sec-WebSocket-Key."""
    # SHA-1 is what RFC 6455 prescribes for this check; it guards nothing secret.
    digest = hashlib.sha1(key.encode() + _GUID, usedforsecurity=False).digest()
    return base64.b64encode(digest).decode()


def encode_frame(opcode: int, payload: bytes, masked: bool = True) -> bytes:
    """One final frame: masked as a client sends it, unmasked as a server does."""
    size = len(payload)
    first = 0x80 | opcode
    bit = 0x80 if masked else 0
    if size < 126:
        head = bytes((first, bit | size))
    elif size < 1 << 16:
        head = bytes((first, bit | 126)) + SHORT.pack(size)
    else:
        head = bytes((first, bit | 127)) + _LONG.pack(size)
    if not masked:
        return head + payload
    key = KEYS.take()
    data = bytearray(payload)
    xor(key, data)
    return head + key + data


class FrameReader:
    """Frames in, whole messages out. `masked`: the frames come from a client, so each must
    be masked (and is unmasked here); otherwise from a server, and none may be."""

    def __init__(self, max_size: int, *, masked: bool = False) -> None:
        self.max_size = max_size
        self._masked = masked
        self._buffer = bytearray()
        self._fragments: list[bytes] = []
        self._fragment_size = 0

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        """(opcode, payload) of every complete message or control frame in `data`."""
        buffer = self._buffer
        buffer += data
        out: list[tuple[int, bytes]] = []
        while True:
            if len(buffer) < 2:
                break
            first, second = buffer[0], buffer[1]
            if first & 0x70:
                raise ProtocolError("reserved bits set")
            if bool(second & 0x80) != self._masked:
                raise ProtocolError(
                    "the client sent an unmasked frame"
                    if self._masked
                    else "the server masked a frame"
                )
            opcode, final, size = first & 0x0F, bool(first & 0x80), second & 0x7F
            start = 2
            if size == 126:
                if len(buffer) < 4:
                    break
                (size,) = SHORT.unpack_from(buffer, 2)
                start = 4
            elif size == 127:
                if len(buffer) < 10:
                    break
                (size,) = _LONG.unpack_from(buffer, 2)
                start = 10
            if opcode >= 0x8 and (size > 125 or not final):
                raise ProtocolError("control frame too long or fragmented")
            if size > self.max_size:
                raise ProtocolError(
                    f"frame of {size} bytes over the limit of {self.max_size}", CLOSE_TOO_BIG
                )
            key_at = start
            if self._masked:
                start += 4
            if len(buffer) < start + size:
                break
            if self._masked:
                masked = buffer[start : start + size]
                xor(bytes(buffer[key_at:start]), masked)
                payload = bytes(masked)
            else:
                payload = bytes(buffer[start : start + size])
            del buffer[: start + size]
            message = self._assemble(opcode, final, payload)
            if message is not None:
                out.append(message)
        return out

    def _assemble(self, opcode: int, final: bool, payload: bytes) -> tuple[int, bytes] | None:
        if opcode >= 0x8:
            if opcode > OP_PONG:
                raise ProtocolError(f"reserved control opcode {opcode:#x}")
            if opcode == OP_CLOSE:
                _check_close(payload)
            return opcode, payload
        if opcode == OP_TEXT:
            raise ProtocolError("text messages are not part of the link protocol")
        if opcode == OP_BINARY:
            if self._fragments:
                raise ProtocolError("a new message before the last one ended")
            if final:
                return opcode, payload
        elif opcode == OP_CONTINUATION:
            if not self._fragments:
                raise ProtocolError("a continuation without a message")
        else:
            raise ProtocolError(f"unknown opcode {opcode:#x}")
        self._fragment_size += len(payload)
        if self._fragment_size > self.max_size:
            raise ProtocolError(f"message over the limit of {self.max_size} bytes", CLOSE_TOO_BIG)
        self._fragments.append(payload)
        if not final:
            return None
        whole = b"".join(self._fragments)
        self._fragments, self._fragment_size = [], 0
        return OP_BINARY, whole


def _check_close(payload: bytes) -> None:
    """A close frame's body is empty, or a status code that may be sent on the wire and a
    UTF-8 reason (RFC 6455, 5.5.1 and 7.4)."""
    if not payload:
        return
    if len(payload) == 1:
        raise ProtocolError("a close frame with a one-byte body")
    (code,) = SHORT.unpack_from(payload)
    if not (1000 <= code <= 1003 or 1007 <= code <= 1014 or 3000 <= code <= 4999):
        raise ProtocolError(f"close code {code} may not be sent")
    try:
        payload[2:].decode("utf-8")
    except UnicodeDecodeError:
        raise ProtocolError("a close reason that is not UTF-8") from None
