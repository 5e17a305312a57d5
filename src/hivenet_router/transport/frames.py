"""The frame codec of the agent connection.

Each WebSocket binary message carries exactly one frame:

    type (u8) | flags (u8) | stream id (u32, big-endian) | payload

WebSocket framing already delimits messages, so frames carry no length of their own; the
connection refuses any message longer than MAX_FRAME. See docs/transport.md.
"""

from __future__ import annotations

import struct
from enum import IntEnum
from typing import Any, NamedTuple

import orjson

HEADER = struct.Struct("!BBI")
WINDOW = struct.Struct("!I")
MAX_PAYLOAD = 64 * 1024
MAX_FRAME = HEADER.size + MAX_PAYLOAD
MAX_STREAM_ID = 2**32 - 1
# aiohttp refuses a message whose size reaches max_msg_size, so allow one byte more.
WS_MAX_MSG_SIZE = MAX_FRAME + 1


class FrameType(IntEnum):
    OPEN = 1  # opens a stream: head {"proto", "method", "path", "headers"}, then body bytes
    HEADERS = 2  # response: head {"status", "headers"}, then body bytes
    DATA = 3  # body bytes
    RESET = 4  # abandons a stream in both directions: {"code", "message"}
    WINDOW = 5  # grants the sender more bytes of DATA on a stream: u32
    GOAWAY = 6  # the sender opens no new streams and will close soon (stream id 0)


END = 0x01  # flag: the sender has nothing more to send on this stream
_KNOWN_FLAGS = END


class FrameError(Exception):
    """A frame that breaks the protocol. The connection that sent it is closed."""


class Frame(NamedTuple):
    type: FrameType
    flags: int
    stream_id: int
    payload: bytes

    @property
    def end(self) -> bool:
        return bool(self.flags & END)


# Every frame passes here (one per chunk of a stream): a dict lookup instead of the enum's
# call, and the tuple made directly instead of through NamedTuple's Python-level __new__.
_TYPES = {kind.value: kind for kind in FrameType}
_new_frame = tuple.__new__


def encode(kind: FrameType, stream_id: int, payload: bytes = b"", flags: int = 0) -> bytes:
    if len(payload) > MAX_PAYLOAD:
        raise FrameError(f"payload of {len(payload)} bytes exceeds {MAX_PAYLOAD}")
    return HEADER.pack(kind, flags, stream_id) + payload


def decode(message: bytes) -> Frame:
    if len(message) < HEADER.size:
        raise FrameError(f"frame of {len(message)} bytes is shorter than its header")
    if len(message) > MAX_FRAME:
        raise FrameError(f"frame of {len(message)} bytes exceeds {MAX_FRAME}")
    kind, flags, stream_id = HEADER.unpack_from(message)
    frame_type = _TYPES.get(kind)
    if frame_type is None:
        raise FrameError(f"unknown frame type {kind}")
    if flags & ~_KNOWN_FLAGS:
        raise FrameError(f"unknown flags {flags:#x}")
    if (stream_id == 0) != (frame_type is FrameType.GOAWAY):
        raise FrameError(f"{frame_type.name} frame on stream {stream_id}")
    return _new_frame(Frame, (frame_type, flags, stream_id, message[HEADER.size :]))


def encode_json(kind: FrameType, stream_id: int, value: Any, flags: int = 0) -> bytes:
    return encode(kind, stream_id, orjson.dumps(value), flags)


def decode_json(frame: Frame) -> dict[str, Any]:
    try:
        value = orjson.loads(frame.payload)
    except orjson.JSONDecodeError as exc:
        raise FrameError(f"{frame.type.name} payload is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise FrameError(f"{frame.type.name} payload is not a JSON object")
    return value


HEAD_LENGTH = struct.Struct("!H")


def encode_head(
    kind: FrameType, stream_id: int, head: dict[str, Any], body: bytes, budget: int, flags: int
) -> tuple[bytes, int]:
    """OPEN and HEADERS frames: a length-prefixed JSON head, then as much of `body` as fits
    in the frame and in `budget` (the peer's credit). Returns the frame and the body bytes
    it carries.

    Carrying a small body in the same frame as its head halves the frames (and TLS records
    and system calls) of a typical request and answer.
    """
    encoded = orjson.dumps(head)
    room = MAX_PAYLOAD - HEAD_LENGTH.size - len(encoded)
    if room < 0:
        raise FrameError(f"{kind.name} head of {len(encoded)} bytes does not fit in a frame")
    inline = min(len(body), room, budget)
    if inline < len(body):
        flags &= ~END
    payload = HEAD_LENGTH.pack(len(encoded)) + encoded + body[:inline]
    return HEADER.pack(kind, flags, stream_id) + payload, inline


def decode_head(frame: Frame) -> tuple[dict[str, Any], bytes]:
    payload = frame.payload
    if len(payload) < HEAD_LENGTH.size:
        raise FrameError(f"{frame.type.name} frame without a head")
    (size,) = HEAD_LENGTH.unpack_from(payload)
    end = HEAD_LENGTH.size + size
    if end > len(payload):
        raise FrameError(f"{frame.type.name} head claims {size} bytes it does not have")
    try:
        head = orjson.loads(payload[HEAD_LENGTH.size : end])
    except orjson.JSONDecodeError as exc:
        raise FrameError(f"{frame.type.name} head is not JSON: {exc}") from None
    if not isinstance(head, dict):
        raise FrameError(f"{frame.type.name} head is not a JSON object")
    return head, payload[end:]


def encode_window(stream_id: int, increment: int) -> bytes:
    return encode(FrameType.WINDOW, stream_id, WINDOW.pack(increment))


def decode_window(frame: Frame) -> int:
    if len(frame.payload) != WINDOW.size:
        raise FrameError("WINDOW payload must be 4 bytes")
    (increment,) = WINDOW.unpack(frame.payload)
    if increment == 0:
        raise FrameError("WINDOW increment of zero")
    return int(increment)
