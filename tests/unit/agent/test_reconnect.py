"""The agent's reconnect loop waits the general reconnect delay (5 s) give or take 20%,
after every failure alike: it never backs off towards 30 s."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest

from hivenet_router.agent.connection import RouterConnection, reconnect_wait
from hivenet_router.agent.discovery import Listed, Verdict
from hivenet_router.agent.session import RouterAuth, RouterRejected, Session
from hivenet_router.config.agent import AgentConfig
from hivenet_router.config.values import ListenAddress
from tests.unit.agent.standin import serving


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


class OneRouter:
    """The manager as one session sees it, with a single router."""

    def address(self, entry_id: int) -> ListenAddress | None:
        return ListenAddress("127.0.0.1", 9)

    def reached(self, entry_id: int, session: Session) -> Verdict:
        return Verdict.GO

    def listed(self, routers: list[Listed]) -> None:
        pass

    def released(self, entry_id: int) -> None:
        pass

    def several(self) -> bool:
        return False

    def routers_up(self) -> list[str]:
        return []


def connection(
    config: AgentConfig, router: RouterAuth, sleep: Callable[[float], Awaitable[None]]
) -> RouterConnection:
    return RouterConnection(1, OneRouter(), serving(config), lambda address: router, sleep)


async def test_the_loop_waits_the_same_after_every_failure() -> None:
    router = DownRouter()
    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)
        if len(waits) == 40:
            raise _Enough

    with pytest.raises(_Enough):
        await connection(AgentConfig(), router, sleep).run()
    assert router.attempts == 40
    assert all(4.0 <= wait <= 6.0 for wait in waits), waits  # the 40th as the first


async def test_the_delay_is_configurable() -> None:
    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)
        if len(waits) == 10:
            raise _Enough

    with pytest.raises(_Enough):
        await connection(AgentConfig(reconnect_delay=0.2), DownRouter(), sleep).run()
    assert all(0.16 <= wait <= 0.24 for wait in waits), waits
