from __future__ import annotations

import msgspec
import pytest

from hivenet_router.domain.agent import Registration


def test_oversized_metadata_is_refused() -> None:
    decoder = msgspec.json.Decoder(Registration)
    base = {"peer_id": "p", "model": "m", "capability": "llm", "engine": "vllm", "capacity": 1}
    for bad in (
        {"region": "x" * 300},
        {"capacity": 0},
        {"tags": ["t"] * 100},
        {"llm_info": "i" * 5000},
        {"unexpected": 1},
    ):
        with pytest.raises(msgspec.ValidationError):
            decoder.decode(msgspec.json.encode({**base, **bad}))
