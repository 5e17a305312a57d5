"""Stand-in agents for policy tests: plain data with the fields policies read."""

from __future__ import annotations

from dataclasses import dataclass, field

from hivenet_router.domain.agent import EngineSnapshot, HardwareSnapshot, Registration


@dataclass
class Agent:
    reg: Registration
    active: int = 0
    eligible: bool = True
    engine: EngineSnapshot | None = None
    hardware: HardwareSnapshot | None = None
    successes: int = 0
    failures: int = 0
    consecutive_failures: int = 0
    srtt_ms: float | None = None
    last_assigned: int = field(default=0)
    last_served: int = field(default=0)

    @property
    def peer_id(self) -> str:
        return self.reg.peer_id

    @property
    def limit(self) -> int:
        return self.reg.capacity


def agent(
    region: str = "eu",
    engine: str = "vllm",
    tags: tuple[str, ...] = ("production",),
    peer: str = "p",
    capability: str = "llm",
    capacity: int = 4,
    **state: object,
) -> Agent:
    reg = Registration(
        peer_id=peer,
        model="m1",
        capability=capability,
        engine=engine,
        capacity=capacity,
        region=region,
        tags=list(tags),
    )
    return Agent(reg, **state)  # type: ignore[arg-type]
