"""The agent's reconnect loop waits the general reconnect delay (5 s) give or take 20%,
after every failure alike: it never backs off towards 30 s."""

from __future__ import annotations

import pytest

from hivenet_router.agent.engines import adapter_for
from hivenet_router.agent.hardware import HardwareSampler
from hivenet_router.agent.monitor import BackendMonitor
from hivenet_router.agent.process import AgentProcess, reconnect_wait
from hivenet_router.agent.proxy import BackendProxy
from hivenet_router.agent.session import RouterRejected, Session
from hivenet_router.config.agent import AgentConfig
from hivenet_router.http1.client import EngineClient
from hivenet_router.transport.identity import Identity

SECRET = b"s" * 48


class _Enough(Exception):
    pass


class DownRouter:
    """A router that is unreachable, then refuses the agent, then is unreachable again..."""

    def __init__(self) -> None:
        self.attempts = 0

    async def authenticate(self) -> Session:
        self.attempts += 1
        if self.attempts % 3 == 0:
            raise RouterRejected("UNAUTHENTICATED: bad token")
        raise ConnectionError("router unreachable: connection refused")


def test_the_wait_is_five_seconds_give_or_take_a_fifth() -> None:
    waits = [reconnect_wait(5.0) for _ in range(2000)]
    assert all(4.0 <= wait <= 6.0 for wait in waits)
    assert max(waits) - min(waits) > 1.0  # jittered, not one fixed value
    assert 4.9 < sum(waits) / len(waits) < 5.1


def test_the_default_delay_is_the_specified_five_seconds() -> None:
    assert AgentConfig().reconnect_delay == 5.0


async def test_the_loop_waits_the_same_after_every_failure() -> None:
    router = DownRouter()
    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)
        if len(waits) == 40:
            raise _Enough

    process = AgentProcess(
        AgentConfig(),
        SECRET,
        Identity.generate(),
        HardwareSampler(frozenset(), load_nvml=False),
        auth=router,
        sleep=sleep,
    )
    backend = EngineClient("http://127.0.0.1:9")
    monitor = BackendMonitor(backend, adapter_for("vllm"))
    proxy = BackendProxy(backend, 1.0, 1.0)
    with pytest.raises(_Enough):
        await process.connect_forever("m", monitor, proxy)
    assert router.attempts == 40
    assert all(4.0 <= wait <= 6.0 for wait in waits), waits  # the 40th as the first


async def test_the_delay_is_configurable() -> None:
    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)
        if len(waits) == 10:
            raise _Enough

    config = AgentConfig(reconnect_delay=0.2)
    process = AgentProcess(
        config,
        SECRET,
        Identity.generate(),
        HardwareSampler(frozenset(), load_nvml=False),
        auth=DownRouter(),
        sleep=sleep,
    )
    backend = EngineClient("http://127.0.0.1:9")
    with pytest.raises(_Enough):
        await process.connect_forever(
            "m", BackendMonitor(backend, adapter_for("vllm")), BackendProxy(backend, 1.0, 1.0)
        )
    assert all(0.16 <= wait <= 0.24 for wait in waits), waits
