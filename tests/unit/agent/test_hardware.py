from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from hivenet_router.agent.hardware import HardwareSampler, read_device_file
from hivenet_router.domain.agent import Registration
from hivenet_router.policy.document import parse_policy


class FakeNvml:
    """The slice of NVML the sampler calls, over two GPUs; the second has no power sensor."""

    NVML_TEMPERATURE_GPU = 0

    def __init__(self) -> None:
        self.gpus = [
            {
                "uuid": b"GPU-aaa",
                "name": "H200",
                "temp": 61,
                "util": 40,
                "mem": (30 << 30, 141 << 30),
                "power": 350_000,
            },
            {
                "uuid": "GPU-bbb",
                "name": "H200",
                "temp": 83,
                "util": 95,
                "mem": (120 << 30, 141 << 30),
                "power": None,
            },
        ]

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> dict[str, Any]:
        return self.gpus[index]

    def nvmlDeviceGetUUID(self, handle: dict[str, Any]) -> Any:
        return handle["uuid"]

    def nvmlDeviceGetName(self, handle: dict[str, Any]) -> str:
        return str(handle["name"])

    def nvmlDeviceGetTemperature(self, handle: dict[str, Any], sensor: int) -> int:
        return int(handle["temp"])

    def nvmlDeviceGetUtilizationRates(self, handle: dict[str, Any]) -> Any:
        return SimpleNamespace(gpu=handle["util"], memory=0)

    def nvmlDeviceGetMemoryInfo(self, handle: dict[str, Any]) -> Any:
        used, total = handle["mem"]
        return SimpleNamespace(used=used, total=total, free=total - used)

    def nvmlDeviceGetPowerUsage(self, handle: dict[str, Any]) -> int:
        if handle["power"] is None:
            raise RuntimeError("not supported")
        return int(handle["power"])


def test_device_file(tmp_path: Path) -> None:
    path = tmp_path / "gpus"
    path.write_text("GPU-aaa,\nGPU-bbb\n")
    assert read_device_file(str(path)) == {"GPU-aaa", "GPU-bbb"}
    path.write_text("none\n")
    assert read_device_file(str(path)) == frozenset()
    path.write_text("")
    assert read_device_file(str(path)) == frozenset()
    assert read_device_file("") is None


def test_sampler_reads_every_visible_gpu_and_tolerates_missing_fields() -> None:
    snapshot = HardwareSampler(None, nvml=FakeNvml()).sample()
    assert [g.uuid for g in snapshot.gpus] == ["GPU-aaa", "GPU-bbb"]
    assert snapshot.gpus[0].power_watts == 350.0 and snapshot.gpus[1].power_watts is None
    assert snapshot.hottest() == 83 and snapshot.busiest() == 95
    assert snapshot.fullest_vram() is not None and 0.85 < snapshot.fullest_vram() < 0.86
    assert snapshot.memory_used_percent is not None


def test_sampler_honours_the_device_file() -> None:
    only = HardwareSampler(frozenset({"GPU-aaa"}), nvml=FakeNvml()).sample()
    assert [g.uuid for g in only.gpus] == ["GPU-aaa"]
    assert HardwareSampler(frozenset(), nvml=None).sample().gpus == []


def test_gpu_gates_read_the_hottest_device() -> None:
    step = parse_policy(
        "routing_policy:\n  strategy: least-loaded\n  exclude_if:\n"
        "    gpu_temperature_c: {gt: 80}\n    gpu_util_percent: {gt: 0.99}\n",
        "p.yaml",
        "p",
        require_models=False,
    ).steps[0]
    reg = Registration(peer_id="p", model="m", capability="llm", engine="vllm", capacity=1)
    hot = SimpleNamespace(
        reg=reg,
        active=0,
        engine=None,
        successes=0,
        failures=0,
        consecutive_failures=0,
        srtt_ms=None,
        hardware=HardwareSampler(None, nvml=FakeNvml()).sample(),
    )
    gate = step.excluded_by(hot)  # type: ignore[arg-type]
    assert gate is not None and gate.signal == "gpu_temperature_c"
    cpu_only = SimpleNamespace(**{**hot.__dict__, "hardware": None})
    assert step.excluded_by(cpu_only) is None  # no GPU: the gates are skipped
