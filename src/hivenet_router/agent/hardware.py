"""CPU and memory snapshots of the agent's host. GPUs come with NVML support later."""

from __future__ import annotations

import psutil

from hivenet_router.domain.agent import HardwareSnapshot


def sample() -> HardwareSnapshot:
    memory = psutil.virtual_memory()
    return HardwareSnapshot(
        cpu_usage_percent=psutil.cpu_percent(interval=None),
        memory_used_percent=memory.percent,
        memory_total_bytes=memory.total,
        memory_available_bytes=memory.available,
    )
