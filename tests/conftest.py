from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.procs import Cluster, cluster


@pytest.fixture
def make_cluster(tmp_path: Path) -> Iterator[Cluster]:
    with cluster(tmp_path) as c:
        yield c
