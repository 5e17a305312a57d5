"""The signals a policy can test, and how each is read from an agent.

A signal an agent does not report is None, and a gate on it passes (missing data never
excludes an agent): combine such a gate with a static `match` on the engine when the
signal matters.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from hivenet_router.domain.agent import EngineSnapshot, HardwareSnapshot, Registration


class AgentFacts(Protocol):
    """What policies may read about an agent. The router's live records satisfy it."""

    @property
    def reg(self) -> Registration: ...

    @property
    def peer_id(self) -> str: ...

    @property
    def eligible(self) -> bool:
        """Connected, healthy (process and backend), not drained and not shutting down."""
        ...

    @property
    def active(self) -> int: ...

    @property
    def limit(self) -> int:
        """Slots routing may fill now: the declared capacity, or fewer while adaptive
        concurrency holds the agent back."""
        ...

    @property
    def last_assigned(self) -> int:
        """Order in which agents were last chosen (lower: longer ago)."""
        ...

    @property
    def last_served(self) -> int:
        """Order of the agent's last success (lower: longer ago, never, or it failed since)."""
        ...

    @property
    def engine(self) -> EngineSnapshot | None: ...

    @property
    def hardware(self) -> HardwareSnapshot | None: ...

    @property
    def successes(self) -> int: ...

    @property
    def failures(self) -> int: ...

    @property
    def consecutive_failures(self) -> int: ...

    @property
    def srtt_ms(self) -> float | None: ...


Reader = Callable[[AgentFacts], float | None]


def _engine(field: str) -> Reader:
    def read(agent: AgentFacts) -> float | None:
        snapshot = agent.engine
        return None if snapshot is None else getattr(snapshot, field)

    return read


def _percent(field: str) -> Reader:
    # Hardware reports 0-100; policies compare fractions.
    def read(agent: AgentFacts) -> float | None:
        snapshot = agent.hardware
        value = None if snapshot is None else getattr(snapshot, field)
        return None if value is None else value / 100.0

    return read


def _fraction(percent: float | None) -> float | None:
    return None if percent is None else percent / 100.0


def _success_rate(agent: AgentFacts) -> float | None:
    total = agent.successes + agent.failures
    return agent.successes / total if total else None


# Every signal a gate may name, with how to read it. Units: fractions 0..1 for rates and
# utilizations, milliseconds for SRTT, seconds for TTFT and ITL, counts otherwise.
SIGNALS: dict[str, Reader] = {
    "capacity_utilization": lambda a: a.active / a.reg.capacity,
    "success_rate": _success_rate,
    "srtt": lambda a: a.srtt_ms,
    "consecutive_failures": lambda a: float(a.consecutive_failures),
    "kv_cache_utilization": _engine("kv_cache_utilization"),
    "running_requests": _engine("running_requests"),
    "waiting_requests": _engine("waiting_requests"),
    "avg_ttft_seconds": _engine("avg_ttft_seconds"),
    "p90_ttft_seconds": _engine("p90_ttft_seconds"),
    "avg_itl_seconds": _engine("avg_itl_seconds"),
    "p90_itl_seconds": _engine("p90_itl_seconds"),
    "memory_used_percent": _percent("memory_used_percent"),
    "cpu_usage_percent": _percent("cpu_usage_percent"),
    # GPUs: the hottest, busiest and fullest device of the agent's host (NVML).
    "gpu_temperature_c": lambda a: a.hardware.hottest() if a.hardware else None,
    "gpu_util_percent": lambda a: _fraction(a.hardware.busiest() if a.hardware else None),
    "gpu_vram_used_percent": lambda a: a.hardware.fullest_vram() if a.hardware else None,
}

# Signals that may be used for front-door shedding (averaged over the healthy pool).
SHED_SIGNALS = ("kv_cache_utilization", "waiting_requests")
