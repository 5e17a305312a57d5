from __future__ import annotations

import pytest

from tests.real.engines import Artefacts, artefacts


@pytest.fixture(scope="session")
def real() -> Artefacts:
    return artefacts()
