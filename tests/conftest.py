from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.procs import Cluster, cluster

# The vLLM tier needs gigabytes and minutes; it runs only from `make test-vllm`.
collect_ignore_glob = [] if os.environ.get("HIVENET_VLLM_TESTS") == "1" else ["vllm/*"]


@pytest.fixture
def make_cluster(tmp_path: Path) -> Iterator[Cluster]:
    with cluster(tmp_path) as c:
        yield c
