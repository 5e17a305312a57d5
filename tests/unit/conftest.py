from __future__ import annotations

from collections.abc import Iterator

import pytest
from blockbuster import BlockBuster, blockbuster_ctx


@pytest.fixture(autouse=True)
def blockbuster() -> Iterator[BlockBuster]:
    """Fail any blocking call (file or socket I/O, sleeping) that the project's own code
    makes on a running event loop: it would stall every request in flight."""
    with blockbuster_ctx("hivenet_router") as guard:
        yield guard
