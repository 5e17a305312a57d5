"""The session manager with stand-in routers: sessions opened from the lists routers hand
out, none twice for one router, one router's failures kept to its own session, and
discovered sessions closed once their router is gone."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable

import pytest

from hivenet_router.agent import discovery
from hivenet_router.agent.discovery import Listed
from hivenet_router.agent.monitor import Pulse
from hivenet_router.agent.routers import Routers
from hivenet_router.agent.session import RouterAuth, Session
from hivenet_router.config.agent import AgentConfig
from hivenet_router.config.values import ListenAddress, host_port
from tests.unit.agent.standin import serving

PEER = "12D3KooWsite"
# The data connection of every stand-in router: nothing listens there, so each session
# authenticates, fails to connect, and starts again.
NOWHERE = "wss://127.0.0.1:9/hivenet/link"


class StandInSite:
    """Routers by address: which answer, under which router ID, with which list."""

    def __init__(self) -> None:
        self.ids: dict[str, str] = {}
        self.lists: dict[str, list[Listed]] = {}
        self.dialled: Counter[str] = Counter()

    def router(self, addr: str, router_id: str, lists: list[str] | None = None) -> None:
        self.ids[addr] = router_id
        self.lists[addr] = [self.listed(a) for a in lists or []]

    def listed(self, addr: str) -> Listed:
        return Listed(self.ids[addr], PEER, host_port(addr))

    def dial(self, address: ListenAddress) -> RouterAuth:
        return StandInAuth(self, str(address))


class StandInAuth:
    def __init__(self, site: StandInSite, addr: str) -> None:
        self.site, self.addr = site, addr

    async def authenticate(self) -> Session:
        self.site.dialled[self.addr] += 1
        router_id = self.site.ids.get(self.addr)
        if router_id is None:
            raise ConnectionError("router unreachable: connection refused")
        return Session(
            token="t",
            challenge=b"c",
            router_peer_id=PEER,
            link_url=NOWHERE,
            heartbeat_interval=0.05,
            renew_at=1e9,
            expires_at=1e9,
            router_id=router_id,
            routers=tuple(self.site.lists.get(self.addr, [])),
        )


def manager(site: StandInSite, routers: str) -> Routers:
    config = AgentConfig(routers=tuple(host_port(a) for a in routers.split(",")))
    config = AgentConfig(routers=config.routers, reconnect_delay=0.02)
    return Routers(serving(config), site.dial)


async def run_until(routers: Routers, done: Callable[[], bool], timeout: float = 5.0) -> None:
    task = asyncio.create_task(routers.run())
    try:
        async with asyncio.timeout(timeout):
            while not done():
                await asyncio.sleep(0.01)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_every_listed_router_gets_a_session_and_none_gets_two() -> None:
    site = StandInSite()
    site.router("10.0.0.1:50051", "r1")
    site.router("10.0.0.2:50051", "r2")
    # Its --routers name lists r0 at its own address, and the two others.
    site.router("10.0.0.0:50051", "r0")
    site.router("router-0.svc:50051", "r0", ["10.0.0.0:50051", "10.0.0.1:50051", "10.0.0.2:50051"])
    routers = manager(site, "router-0.svc:50051")
    await run_until(routers, lambda: min(site.dialled.values(), default=0) >= 5)
    assert set(site.dialled) == {"router-0.svc:50051", "10.0.0.1:50051", "10.0.0.2:50051"}
    assert len(routers.book.entries) == 3


async def test_a_router_that_is_down_does_not_hold_back_the_others(
    caplog: pytest.LogCaptureFixture,
) -> None:
    site = StandInSite()
    site.router("10.0.0.2:50051", "r2")
    site.router("10.0.0.1:50051", "r1", ["10.0.0.2:50051"])
    routers = manager(site, "10.0.0.9:50051,10.0.0.1:50051")  # nothing at 10.0.0.9
    with caplog.at_level(logging.INFO, logger="hivenet.agent"):
        await run_until(routers, lambda: site.dialled["10.0.0.9:50051"] >= 10)
    assert site.dialled["10.0.0.2:50051"] >= 1  # found through r1 meanwhile
    unreachable = [r for r in caplog.records if "10.0.0.9:50051 unreachable" in r.getMessage()]
    assert len(unreachable) == 1  # ten failures, one line


async def test_a_discovered_router_gone_from_every_list_is_closed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(discovery, "FORGET_AFTER", 0.2)
    site = StandInSite()
    site.router("10.0.0.2:50051", "r2")
    site.router("10.0.0.1:50051", "r1", ["10.0.0.2:50051"])
    routers = manager(site, "10.0.0.1:50051")
    await run_until(routers, lambda: site.dialled["10.0.0.2:50051"] >= 1)
    # r2 leaves the site: the lists stop naming it and it stops answering.
    site.lists["10.0.0.1:50051"] = []
    del site.ids["10.0.0.2:50051"]
    await run_until(routers, lambda: routers.open_sessions == 1)
    attempts = site.dialled["10.0.0.2:50051"]
    await run_until(routers, lambda: site.dialled["10.0.0.1:50051"] >= 20)
    assert site.dialled["10.0.0.2:50051"] == attempts  # closed: never dialled again


async def test_a_pulse_wakes_every_session_not_only_the_first() -> None:
    pulse = Pulse()
    seen = pulse.version
    waiters = [asyncio.create_task(pulse.wait(seen, 5.0)) for _ in range(3)]
    await asyncio.sleep(0)
    pulse.notify()
    assert await asyncio.gather(*waiters) == [True, True, True]
    assert await pulse.wait(seen, 5.0)  # one that was busy meanwhile still sees it
    assert not await pulse.wait(pulse.version, 0.01)  # nothing new: the timeout


async def test_two_routers_under_one_router_id_are_named_in_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Two router processes of one host that both call themselves by the hostname: the
    # agent cannot tell them apart and registers with one only. It says so, once.
    site = StandInSite()
    site.router("127.0.0.1:50051", "gpu-box")
    site.router("127.0.0.1:50052", "gpu-box")
    routers = manager(site, "127.0.0.1:50051,127.0.0.1:50052")
    with caplog.at_level(logging.INFO, logger="hivenet.agent"):
        await run_until(routers, lambda: min(site.dialled.values(), default=0) >= 10)
    warned = [r for r in caplog.records if "both answer as router ID" in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING
    text = warned[0].getMessage()
    assert "127.0.0.1:50051" in text and "127.0.0.1:50052" in text and "'gpu-box'" in text
    assert "give each its own --router-id" in text


async def test_routers_with_their_own_ids_raise_no_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    site = StandInSite()
    site.router("127.0.0.1:50051", "gpu-box")
    site.router("127.0.0.1:50052", "gpu-box-50052")
    routers = manager(site, "127.0.0.1:50051,127.0.0.1:50052")
    with caplog.at_level(logging.INFO, logger="hivenet.agent"):
        await run_until(routers, lambda: min(site.dialled.values(), default=0) >= 5)
    assert "both answer as router ID" not in caplog.text
