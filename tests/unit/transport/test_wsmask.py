"""The link's XOR mask and masking keys."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
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


def _run(script: str, env: dict[str, str] | None = None) -> None:
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, **(env or {})},
    )
    assert done.returncode == 0, done.stderr


def test_aiohttp_no_extensions_means_the_python_xor() -> None:
    _run(
        "from hivenet_router.transport import wsmask\n"
        "assert not wsmask.COMPILED\n"
        "assert wsmask.xor is wsmask.xor_python\n"
        "assert wsmask.mask(b'abcd', b'\\x01\\x02\\x03\\x04') == b'\\x60\\x60\\x60\\x60'\n",
        env={"AIOHTTP_NO_EXTENSIONS": "1"},
    )


def test_loading_the_compiled_xor_does_not_import_aiohttp_and_aiohttp_shares_it() -> None:
    _run(
        "import sys\n"
        "from hivenet_router.transport import wsmask\n"
        "assert wsmask.COMPILED\n"
        "assert 'aiohttp' not in sys.modules, 'aiohttp was imported'\n"
        "from aiohttp._websocket import helpers\n"
        "assert helpers.websocket_mask is wsmask.xor, 'aiohttp fell back to its Python XOR'\n"
    )


def test_an_aiohttp_imported_first_lends_its_compiled_xor() -> None:
    _run(
        "import sys\n"
        "from aiohttp._websocket import helpers\n"
        "from hivenet_router.transport import wsmask\n"
        "assert wsmask.xor is helpers.websocket_mask\n"
        "assert wsmask.xor is sys.modules['aiohttp._websocket.mask']._websocket_mask_cython\n"
    )


def test_masked_frames_round_trip_through_the_reader() -> None:
    reader = FrameReader(max_size=100_000, masked=True)
    payloads = [b"", b"x", bytes(range(256)) * 10, b"y" * 70_000]
    frames = [encode_frame(0x2, payload) for payload in payloads]
    assert all(isinstance(frame, bytes) for frame in frames)
    joined = b"".join(frames)
    got = reader.feed(joined[:3]) + reader.feed(joined[3:])
    assert got == [(0x2, payload) for payload in payloads]


def test_keys_come_in_batches_and_differ(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = os.urandom

    def counting(size: int) -> bytes:
        calls.append(size)
        return real(size)

    monkeypatch.setattr(os, "urandom", counting)
    keys = MaskKeys(batch=4)
    taken = [keys.take() for _ in range(4000)]
    assert calls == [16] * 1000  # one system call per four keys
    assert all(len(key) == 4 for key in taken)
    assert len(set(taken)) > 3990  # 4,000 draws from 2**32: a repeat or two at most


def test_a_forked_child_does_not_reuse_its_parent_s_keys() -> None:
    # In a process of its own: forking pytest (with its threads) is not something to do.
    _run(
        "import os\n"
        "from hivenet_router.transport.wsmask import KEYS\n"
        "KEYS.forget()\n"
        "assert len(KEYS.take()) == 4  # a fresh batch, 1,023 keys left in it\n"
        "read_end, write_end = os.pipe()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    try:\n"
        "        os.write(write_end, KEYS.take())\n"
        "    finally:\n"
        "        os._exit(0)\n"
        "os.close(write_end)\n"
        "child = os.read(read_end, 4)\n"
        "os.waitpid(pid, 0)\n"
        "assert len(child) == 4\n"
        "assert child != KEYS.take(), 'the child took its parent\\'s next key'\n"
    )
