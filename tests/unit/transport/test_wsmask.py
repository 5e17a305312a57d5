"""The link's XOR mask and masking keys."""

from __future__ import annotations

import os
import subprocess
import sys

from hypothesis import given, settings
from hypothesis import strategies as st

from hivenet_router.transport import wsmask
from hivenet_router.transport.wsframes import FrameReader, encode_frame
from hivenet_router.transport.wsmask import MaskKeys, checks_out, mask, xor, xor_python


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=5000), st.binary(min_size=4, max_size=4))
def test_the_xor_in_use_agrees_with_the_pure_python_one(payload: bytes, key: bytes) -> None:
    fast, slow = bytearray(payload), bytearray(payload)
    xor(key, fast)
    xor_python(key, slow)
    assert fast == slow
    assert mask(mask(payload, key), key) == payload


def test_aiohttp_s_compiled_xor_is_in_use_here() -> None:
    # aiohttp is a dependency, so a silent fall back to the slow XOR would be a regression.
    assert wsmask.COMPILED
    assert xor is not xor_python


def test_a_wrong_xor_is_refused() -> None:
    def forgets_the_tail(key: bytes, data: bytearray) -> None:
        whole = len(data) - len(data) % 4
        head = bytearray(data[:whole])
        xor_python(key, head)
        data[:whole] = head

    assert checks_out(xor_python)
    assert not checks_out(forgets_the_tail)


def test_loading_the_compiled_xor_does_not_import_aiohttp_and_aiohttp_still_loads() -> None:
    script = (
        "import sys\n"
        "from hivenet_router.transport import wsmask\n"
        "assert wsmask.COMPILED\n"
        "assert 'aiohttp' not in sys.modules, 'aiohttp was imported'\n"
        "from aiohttp._websocket.helpers import websocket_mask\n"
        "data = bytearray(b'abcdefgh')\n"
        "websocket_mask(b'\\x01\\x02\\x03\\x04', data)\n"
        "assert bytes(data) == wsmask.mask(b'abcdefgh', b'\\x01\\x02\\x03\\x04')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr


def test_masked_frames_round_trip_through_the_reader() -> None:
    reader = FrameReader(max_size=100_000, masked=True)
    payloads = [b"", b"x", bytes(range(256)) * 10, b"y" * 70_000]
    frames = [encode_frame(0x2, payload) for payload in payloads]
    assert all(isinstance(frame, bytes) for frame in frames)
    joined = b"".join(frames)
    got = reader.feed(joined[:3]) + reader.feed(joined[3:])
    assert got == [(0x2, payload) for payload in payloads]


def test_keys_come_in_batches_and_differ() -> None:
    keys = MaskKeys(batch=4)
    taken = [keys.take() for _ in range(4000)]
    assert all(len(key) == 4 for key in taken)
    assert len(set(taken)) > 3990  # 4,000 draws from 2**32: a repeat or two at most


def test_a_forked_child_does_not_reuse_its_parent_s_keys() -> None:
    first = wsmask.KEYS.take()  # the parent now holds a batch
    assert len(first) == 4
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report the key it would use next, then leave at once
        os.write(write_end, wsmask.KEYS.take())
        os._exit(0)
    os.close(write_end)
    child = os.read(read_end, 4)
    os.close(read_end)
    os.waitpid(pid, 0)
    assert len(child) == 4
    assert child != wsmask.KEYS.take()
