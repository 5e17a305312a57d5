from __future__ import annotations

import socket

import pytest

from hivenet_router.config.router import RouterConfig
from hivenet_router.domain.site import USUAL_GRPC_PORT, default_router_id


@pytest.fixture
def host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(socket, "gethostname", lambda: "gpu box.example")


@pytest.mark.usefixtures("host")
def test_the_default_router_id_is_the_hostname_on_the_usual_agent_port() -> None:
    assert default_router_id(USUAL_GRPC_PORT) == "gpu-box.example"
    assert RouterConfig().grpc_port.port == USUAL_GRPC_PORT  # the option's default


@pytest.mark.usefixtures("host")
def test_routers_of_one_host_on_other_agent_ports_get_their_own_ids() -> None:
    assert default_router_id(50052) == "gpu-box.example-50052"
    assert default_router_id(50053) != default_router_id(50052)


def test_a_long_hostname_keeps_the_port_within_64_characters(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(socket, "gethostname", lambda: "h" * 80)
    assert default_router_id(USUAL_GRPC_PORT) == "h" * 64
    named = default_router_id(50052)
    assert len(named) == 64 and named.endswith("-50052")
