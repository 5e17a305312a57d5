"""RFC 6455 masking for the agent link: the XOR over a frame's payload, and masking keys.

Every frame an agent sends is masked, and the router unmasks every frame it receives. The
XOR runs once per frame on each side, so it is on the hot path of both processes:

- `xor` is aiohttp's compiled XOR when it is installed (it is a dependency, so it normally
  is), and otherwise a pure-Python one that is ten to fifty times slower (the XOR alone:
  3.5 us against 0.07 us for a 1.3 KB payload, 32 us against 0.5 us for 16 KB). The agent
  does not import aiohttp otherwise (its package costs about 8 MiB per process), so the
  compiled module is loaded from its file without running aiohttp's package
  initialisation. It registers itself in sys.modules under its own name
  (aiohttp._websocket.mask), so an aiohttp imported later in the same process shares it.
  The compiled XOR is checked against known answers before it is used; if anything about
  it is off, the pure-Python one is used instead (the agent logs a warning at start). As
  in aiohttp itself, AIOHTTP_NO_EXTENSIONS set to anything non-empty means the Python one.
- `KEYS` hands out masking keys from the operating system's random source, fetched 1,024
  keys at a time: one system call per 1,024 frames instead of one per frame. A forked child
  drops the batch it inherited, so parent and child never share keys.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path

XorInPlace = Callable[[bytes, bytearray], None]

_COMPILED_NAME = "aiohttp._websocket.mask"
_COMPILED_FUNCTION = "_websocket_mask_cython"


def xor_python(key: bytes, data: bytearray) -> None:
    """XOR `data` in place with the 4-byte `key` repeated (the mask is its own inverse)."""
    size = len(data)
    if size:
        stream = (key * (size // 4 + 1))[:size]
        value = int.from_bytes(data, "little") ^ int.from_bytes(stream, "little")
        data[:] = value.to_bytes(size, "little")


def checks_out(candidate: XorInPlace) -> bool:
    """Does `candidate` agree with `xor_python` on payloads of every length up to a word past
    a boundary? A compiled XOR that does not is never used."""
    key = b"\x5a\xc3\x01\xfe"
    for size in (0, 1, 3, 4, 5, 7, 8, 9, 15, 16, 17, 63, 64, 65, 1000):
        original = bytes((i * 37 + 11) & 0xFF for i in range(size))
        expected, got = bytearray(original), bytearray(original)
        xor_python(key, expected)
        candidate(key, got)
        if got != expected:
            return False
    return True


def _load_compiled() -> XorInPlace | None:
    """aiohttp's compiled XOR, or None where it cannot be had, does not check out, or the
    operator turned aiohttp's extensions off."""
    if os.environ.get("AIOHTTP_NO_EXTENSIONS"):
        return None
    try:
        module = sys.modules.get(_COMPILED_NAME)
        if module is None:
            spec = importlib.util.find_spec("aiohttp")  # finds the package, runs nothing
            folders = list(spec.submodule_search_locations or []) if spec is not None else []
            candidates = (
                Path(folder, "_websocket", "mask" + suffix)
                for folder in folders
                for suffix in importlib.machinery.EXTENSION_SUFFIXES
            )
            path = next((candidate for candidate in candidates if candidate.is_file()), None)
            if path is None:
                return None
            loader = importlib.machinery.ExtensionFileLoader(_COMPILED_NAME, str(path))
            module_spec = importlib.util.spec_from_file_location(
                _COMPILED_NAME, path, loader=loader
            )
            if module_spec is None:
                return None
            module = importlib.util.module_from_spec(module_spec)
            loader.exec_module(module)
        function = getattr(module, _COMPILED_FUNCTION, None)
        if function is None or not callable(function):
            return None
        compiled: XorInPlace = function
        return compiled if checks_out(compiled) else None
    except Exception:  # any trouble here means: use the pure-Python XOR
        return None


_compiled = _load_compiled()
xor: XorInPlace = _compiled if _compiled is not None else xor_python
COMPILED = _compiled is not None


def mask(payload: bytes, key: bytes) -> bytes:
    """`payload` XORed with the repeated `key`, as a new bytes object."""
    data = bytearray(payload)
    xor(key, data)
    return bytes(data)


class MaskKeys:
    """Four-byte masking keys from os.urandom, fetched `batch` keys at a time.

    The keys stay as unpredictable as RFC 6455 asks (they come from the same source); only
    the system calls are fewer. Meant for one thread (the link writes from its loop): two
    threads taking at once could both get the same key, which is all that could go wrong."""

    __slots__ = ("_at", "_batch", "_pool")

    def __init__(self, batch: int = 1024) -> None:
        self._batch = batch * 4
        self._pool = b""
        self._at = 0

    def take(self) -> bytes:
        pool, at = self._pool, self._at
        if at >= len(pool):
            pool = self._pool = os.urandom(self._batch)
            at = 0
        self._at = at + 4
        return pool[at : at + 4]

    def forget(self) -> None:
        """Drop the keys fetched so far (a forked child must not reuse its parent's)."""
        self._pool = b""
        self._at = 0


KEYS = MaskKeys()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=KEYS.forget)
