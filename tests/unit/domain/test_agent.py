from __future__ import annotations

import msgspec
import pytest

from hivenet_router.domain.agent import EngineSnapshot, Heartbeat, Registration


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


def test_figures_out_of_sense_are_dropped_and_the_heartbeat_taken() -> None:
    body = (
        b'{"backend_healthy": true, "hardware": {"memory_total_bytes": ' + b"9" * 400 + b","
        b' "memory_available_bytes": -5, "gpus": [{"uuid": "g", "vram_used_bytes": 1,'
        b' "vram_total_bytes": 18446744073709551616}]},'
        b' "engine": {"avg_itl_seconds": 1e-310, "p90_itl_seconds": 0.02,'
        b' "kv_cache_tokens": 1e308, "kv_cache_utilization": 3.0, "running_requests": -1,'
        b' "avg_ttft_seconds": 0, "prompt_tokens_total": 12345}}'
    )
    beat = msgspec.json.decode(body, type=Heartbeat)
    assert beat.hardware is not None and beat.engine is not None
    assert beat.hardware.memory_total_bytes is None
    assert beat.hardware.memory_available_bytes is None
    assert beat.hardware.gpus[0].vram_total_bytes is None
    assert beat.hardware.fullest_vram() is None
    engine = beat.engine
    assert engine.avg_itl_seconds is None and engine.p90_itl_seconds == 0.02
    assert engine.kv_cache_tokens is None and engine.kv_cache_utilization is None
    assert engine.running_requests is None
    assert engine.avg_ttft_seconds == 0 and engine.prompt_tokens_total == 12345
    # The same checks hold where the agent builds its snapshot.
    assert EngineSnapshot(avg_itl_seconds=float("nan")).avg_itl_seconds is None
