"""What an agent sends the router about its engine and hardware, and when."""

from __future__ import annotations

from hivenet_router.agent.monitor import signal_key
from hivenet_router.domain.agent import EngineSnapshot, GpuSnapshot, HardwareSnapshot


def hardware(cpu: float, util: float, used: int) -> HardwareSnapshot:
    gpu = GpuSnapshot("GPU-1", util_percent=util, vram_used_bytes=used, vram_total_bytes=1000)
    return HardwareSnapshot(cpu_usage_percent=cpu, memory_used_percent=40.0, gpus=[gpu])


def test_signals_are_sent_again_only_when_routing_would_notice() -> None:
    idle = EngineSnapshot(running_requests=0, kv_cache_utilization=0.0)
    base = signal_key(idle, hardware(3.0, 0.0, 100))
    assert signal_key(idle, hardware(4.0, 1.0, 104)) == base  # jitter of an idle machine
    assert signal_key(idle, hardware(30.0, 0.0, 100)) != base  # CPU load arrived
    assert signal_key(idle, hardware(3.0, 0.0, 200)) != base  # VRAM filled
    busy = EngineSnapshot(running_requests=1, kv_cache_utilization=0.0)
    assert signal_key(busy, hardware(3.0, 0.0, 100)) != base  # any engine change
    assert signal_key(idle, None) != base
