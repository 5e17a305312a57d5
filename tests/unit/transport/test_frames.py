from __future__ import annotations

import contextlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hivenet_router.transport import frames
from hivenet_router.transport.frames import END, FrameError, FrameType

_STREAM_TYPES = [t for t in FrameType if t is not FrameType.GOAWAY]


@given(
    kind=st.sampled_from(_STREAM_TYPES),
    stream_id=st.integers(min_value=1, max_value=frames.MAX_STREAM_ID),
    payload=st.binary(max_size=2048),
    end=st.booleans(),
)
def test_roundtrip(kind: FrameType, stream_id: int, payload: bytes, end: bool) -> None:
    frame = frames.decode(frames.encode(kind, stream_id, payload, END if end else 0))
    assert (frame.type, frame.stream_id, frame.payload, frame.end) == (
        kind,
        stream_id,
        payload,
        end,
    )


@given(st.binary(max_size=64))
def test_decode_never_crashes_on_garbage(data: bytes) -> None:
    with contextlib.suppress(FrameError):
        frames.decode(data)


def test_limits_and_malformed_frames() -> None:
    with pytest.raises(FrameError):
        frames.encode(FrameType.DATA, 1, b"x" * (frames.MAX_PAYLOAD + 1))
    with pytest.raises(FrameError, match="exceeds"):
        frames.decode(frames.HEADER.pack(FrameType.DATA, 0, 1) + b"x" * (frames.MAX_PAYLOAD + 1))
    with pytest.raises(FrameError, match="shorter"):
        frames.decode(b"\x03\x00")
    with pytest.raises(FrameError, match="unknown frame type"):
        frames.decode(frames.HEADER.pack(99, 0, 1))
    with pytest.raises(FrameError, match="flags"):
        frames.decode(frames.HEADER.pack(FrameType.DATA, 0x80, 1))
    with pytest.raises(FrameError, match="stream 0"):
        frames.decode(frames.HEADER.pack(FrameType.DATA, 0, 0))
    with pytest.raises(FrameError):
        frames.decode_window(frames.decode(frames.encode(FrameType.WINDOW, 1, b"\0\0\0\0")))
    with pytest.raises(FrameError, match="JSON"):
        frames.decode_json(frames.decode(frames.encode(FrameType.OPEN, 1, b"{nope")))
    assert frames.decode_window(frames.decode(frames.encode_window(3, 500))) == 500


def test_head_frames_carry_what_fits() -> None:
    head = {"status": 200, "headers": [["a", "b"]]}
    frame, inline = frames.encode_head(FrameType.HEADERS, 5, head, b"body", 100, END)
    assert inline == 4
    decoded = frames.decode(frame)
    assert decoded.end and frames.decode_head(decoded) == (head, b"body")
    big = b"x" * (frames.MAX_PAYLOAD * 2)
    frame, inline = frames.encode_head(FrameType.HEADERS, 5, head, big, 10**9, END)
    decoded = frames.decode(frame)
    assert 0 < inline < len(big) and not decoded.end
    frame, inline = frames.encode_head(FrameType.OPEN, 5, head, b"body", 2, END)
    assert inline == 2 and not frames.decode(frame).end


def test_head_frames_that_lie() -> None:
    lying = frames.encode(FrameType.HEADERS, 1, frames.HEAD_LENGTH.pack(500) + b"{}")
    with pytest.raises(FrameError, match="claims"):
        frames.decode_head(frames.decode(lying))
    with pytest.raises(FrameError, match="without a head"):
        frames.decode_head(frames.decode(frames.encode(FrameType.HEADERS, 1, b"\x00")))
    not_object = frames.encode(FrameType.OPEN, 1, frames.HEAD_LENGTH.pack(2) + b"[]")
    with pytest.raises(FrameError, match="not a JSON object"):
        frames.decode_head(frames.decode(not_object))
