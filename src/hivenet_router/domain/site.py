"""The routers of one site, as agents are told about them (discovery).

Every router of a site shares the agent secret, so they share the TLS key agents pin and
its peer ID: a router is told apart by its `router_id` (--router-id), which it sends in the
authentication response. `addr` is what agents dial (--advertise-grpc-addr).
"""

from __future__ import annotations

import socket
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SiteRouter:
    router_id: str
    peer_id: str
    addr: str  # HOST:PORT of the agent authentication endpoint; "" when not advertised

    def wire(self) -> dict[str, str]:
        return {"router_id": self.router_id, "peer_id": self.peer_id, "addr": self.addr}


# --grpc-port's default: a router listening there is named by its hostname alone.
USUAL_GRPC_PORT = 50051


def default_router_id(grpc_port: int) -> str:
    """The hostname (the site specification's default), cut to what a router ID may hold;
    with `-PORT` after it when the router's agent port is not the usual one. Two router
    processes of one host need two agent ports, so they get two IDs: with the hostname
    alone, agents took them for one router and registered with only one of them."""
    name = "".join(ch if ch.isalnum() or ch in "._-" else "-" for ch in socket.gethostname())
    name = name or "router"
    if grpc_port in (0, USUAL_GRPC_PORT):
        return name[:64]
    suffix = f"-{grpc_port}"
    return name[: 64 - len(suffix)] + suffix


class SiteDirectory:
    """This router and the live routers of its site that advertise an address."""

    def __init__(self, me: SiteRouter) -> None:
        self.me = me
        self._peers: tuple[SiteRouter, ...] = ()
        self._wire: list[dict[str, str]] = self._render()

    @property
    def peers(self) -> tuple[SiteRouter, ...]:
        return self._peers

    def update(self, peers: Iterable[SiteRouter]) -> None:
        """The other live routers, as the last sync round saw them."""
        fresh = tuple(sorted(peers, key=lambda peer: peer.router_id))
        if fresh != self._peers:
            self._peers = fresh
            self._wire = self._render()

    def routers(self) -> list[dict[str, str]]:
        """What agents are handed: every live router with an advertised address."""
        return self._wire

    def _render(self) -> list[dict[str, str]]:
        return [router.wire() for router in (self.me, *self._peers) if router.addr]
