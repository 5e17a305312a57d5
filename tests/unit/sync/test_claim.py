"""A router ID another live process of the site runs under, against a real valkey-server."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import AsyncIterator, Callable

import pytest

from hivenet_router.clock import SystemClock
from hivenet_router.config.router import RouterConfig
from hivenet_router.domain.site import SiteDirectory, SiteRouter
from hivenet_router.sync import claim
from hivenet_router.sync.entries import Peer
from hivenet_router.sync.site import Site

Maker = Callable[..., Site]


@pytest.fixture
async def make(flushed: str) -> AsyncIterator[Maker]:
    made: list[Site] = []

    def build(name: str, addr: str = flushed) -> Site:
        config = RouterConfig(
            sync_store="valkey", sync_addr=addr, router_id=name, sync_interval=0.1
        )
        config.validate()
        site = Site(config, SystemClock(), SiteDirectory(SiteRouter(name, "peer", "")))
        made.append(site)
        return site

    yield build
    for site in made:
        site.credits.cancel()
        await site.client.aclose()


@contextlib.asynccontextmanager
async def running(site: Site) -> AsyncIterator[None]:
    """`site` heartbeats every sync interval, as a live router does."""
    await site.round()

    async def rounds() -> None:
        while True:
            await asyncio.sleep(site.config.sync_interval)
            await site.round()

    task = asyncio.create_task(rounds())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_a_free_router_id_is_free(make: Maker) -> None:
    async with running(make("other")):
        assert await make("a").claimed_by() is None


async def test_a_live_process_under_the_same_id_is_named(make: Maker) -> None:
    async with running(make("a")):
        holder = await make("a").claimed_by()
    assert holder is not None
    assert holder.startswith(f"process {os.getpid()} on host {socket.gethostname()}")
    assert "agent port :50051" in holder and "last heartbeat" in holder


async def test_the_last_heartbeat_of_a_crashed_process_is_waited_out(make: Maker) -> None:
    crashed = make("a")
    await crashed.round()  # and no more: the process died
    loop = asyncio.get_running_loop()
    started = loop.time()
    assert await make("a").claimed_by() is None
    # The live window (at least 3 s) from that heartbeat, not more.
    assert loop.time() - started < 3.0 + 2.0


async def test_a_store_that_cannot_answer_does_not_stop_the_router(
    make: Maker, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        assert await make("a", addr="127.0.0.1:1").claimed_by() is None
    assert "could not check in the site store" in caplog.text


def test_a_router_before_these_fields_is_named_by_its_process_id() -> None:
    peer = Peer("a", 1_000, {"inc": "0123abcd", "addr": ""})
    assert (
        claim.describe(peer, 3_500) == "the router process 0123abcd (its last heartbeat 2.5s ago)"
    )
