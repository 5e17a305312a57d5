"""Snapshots of the agent's host: CPU and memory (psutil), NVIDIA GPUs (NVML) when present.

NVML is loaded lazily: a host without the NVIDIA driver simply reports no GPUs. With
--gpu-devices-file, only the GPUs whose UUIDs it lists are reported (`none`, or an empty
file, reports none); without it, every GPU the process can see.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import psutil

from hivenet_router.domain.agent import GpuSnapshot, HardwareSnapshot

log = logging.getLogger("hivenet.hardware")


def read_device_file(path: str) -> frozenset[str] | None:
    """The GPU UUIDs to report: None for all, an empty set for none."""
    if not path:
        return None
    text = Path(path).read_text()
    items = {item.strip() for item in text.replace(",", "\n").splitlines() if item.strip()}
    if items == {"none"}:
        return frozenset()
    return frozenset(items)


def _load_nvml() -> Any:
    try:
        import pynvml  # noqa: PLC0415 (optional: only hosts with NVIDIA drivers use it)

        pynvml.nvmlInit()
    except Exception as exc:  # the library raises its own error classes, or ImportError
        log.info("no NVIDIA GPU metrics on this host (%s)", type(exc).__name__)
        return None
    return pynvml


class HardwareSampler:
    def __init__(
        self, devices: frozenset[str] | None, nvml: Any = None, load_nvml: bool = True
    ) -> None:
        self._devices = devices
        self._nvml = nvml
        if nvml is None and load_nvml and devices != frozenset():
            self._nvml = _load_nvml()
        self._warned = False

    def sample(self) -> HardwareSnapshot:
        """Blocking (NVML calls): run it in a worker thread."""
        memory = psutil.virtual_memory()
        return HardwareSnapshot(
            cpu_usage_percent=psutil.cpu_percent(interval=None),
            memory_used_percent=memory.percent,
            memory_total_bytes=memory.total,
            memory_available_bytes=memory.available,
            gpus=self._gpus(),
        )

    def _gpus(self) -> list[GpuSnapshot]:
        nvml = self._nvml
        if nvml is None:
            return []
        gpus = []
        try:
            for index in range(nvml.nvmlDeviceGetCount()):
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                uuid = _text(nvml.nvmlDeviceGetUUID(handle))
                if self._devices is not None and uuid not in self._devices:
                    continue
                gpus.append(self._one(nvml, handle, uuid, index))
        except Exception as exc:
            if not self._warned:
                log.warning("reading GPU metrics failed: %s", exc)
                self._warned = True
        return gpus

    @staticmethod
    def _one(nvml: Any, handle: Any, uuid: str, index: int) -> GpuSnapshot:
        def attempt(fn: Any, *args: Any) -> Any:
            try:
                return fn(handle, *args)
            except Exception:  # a field this GPU or driver does not support is absent
                return None

        memory = attempt(nvml.nvmlDeviceGetMemoryInfo)
        util = attempt(nvml.nvmlDeviceGetUtilizationRates)
        power = attempt(nvml.nvmlDeviceGetPowerUsage)
        return GpuSnapshot(
            uuid=uuid,
            index=index,
            name=_text(attempt(nvml.nvmlDeviceGetName) or ""),
            temperature_c=attempt(nvml.nvmlDeviceGetTemperature, nvml.NVML_TEMPERATURE_GPU),
            util_percent=None if util is None else float(util.gpu),
            vram_used_bytes=None if memory is None else int(memory.used),
            vram_total_bytes=None if memory is None else int(memory.total),
            vram_free_bytes=None if memory is None else int(memory.free),
            power_watts=None if power is None else power / 1000.0,
        )


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
