"""The options of `hivenet-router` that open its ports: the four listen addresses and the
bounds on each port's connections (how many, from one address, and how long a connection
may take to show it is genuine). RouterConfig (config/router.py) extends them, so every
option is still declared once and listed in the order the help and the docs show."""

from __future__ import annotations

from dataclasses import dataclass

from hivenet_router.config import values as v
from hivenet_router.config.options import duration_option, option


@dataclass(frozen=True, slots=True)
class PortOptions:
    http_port: v.ListenAddress = option(
        v.listen_address(":8080"),
        parse=v.listen_address,
        flag="--http-port",
        env="HIVENET_ROUTER_HTTP_PORT",
        help="Listen address of the client API (/health, /v1/*)",
    )
    grpc_port: v.ListenAddress = option(
        v.listen_address(":50051"),
        parse=v.listen_address,
        flag="--grpc-port",
        env="HIVENET_ROUTER_GRPC_PORT",
        help="Listen address of the agent authentication endpoint (TLS 1.3, pinned key)",
    )
    metrics_port: v.ListenAddress = option(
        v.listen_address(":2112"),
        parse=v.listen_address,
        flag="--metrics-port",
        env="HIVENET_ROUTER_METRICS_PORT",
        help="Listen address of the Prometheus /metrics endpoint (no authentication)",
    )
    p2p_port: int = option(
        9000,
        parse=v.dial_port,
        flag="--p2p-port",
        env="HIVENET_ROUTER_P2P_PORT",
        help="TCP port of the agent data connection (TLS WebSocket); agents are told it, so not 0",
    )
    p2p_listen_addr: str = option(
        "127.0.0.1",
        parse=v.text,
        flag="--p2p-listen-addr",
        help="IP address the agent data connection binds to; 0.0.0.0 for remote agents",
    )
    p2p_announce_addr: str = option(
        "",
        parse=v.multiaddr,
        flag="--p2p-announce-addr",
        help="Multiaddress agents should dial, when the bind address is not reachable as is",
    )
    p2p_max_conns_per_ip: int = option(
        32,
        parse=v.positive_int,
        flag="--p2p-max-conns-per-ip",
        env="HIVENET_ROUTER_P2P_MAX_CONNS_PER_IP",
        help="Most agent connections from one IPv4 /32 or IPv6 /56",
    )
    p2p_max_conns: int = option(
        4096,
        parse=v.positive_int,
        flag="--p2p-max-conns",
        env="HIVENET_ROUTER_P2P_MAX_CONNS",
        help="Most agent links (connections holding a valid session) in all; lowered to fit "
        "the open-files limit",
    )
    p2p_max_pending: int = option(
        256,
        parse=v.positive_int,
        flag="--p2p-max-pending",
        env="HIVENET_ROUTER_P2P_MAX_PENDING",
        help="Most agent-port connections that have not yet shown a valid session (in TLS, "
        "or before their upgrade) in all; lowered to fit the open-files limit",
    )
    grpc_max_conns_per_ip: int = option(
        8,
        parse=v.positive_int,
        flag="--grpc-max-conns-per-ip",
        env="HIVENET_ROUTER_GRPC_MAX_CONNS_PER_IP",
        help="Most connections to the agent authentication port from one IPv4 address or IPv6 /56",
    )
    grpc_max_conns: int = option(
        256,
        parse=v.positive_int,
        flag="--grpc-max-conns",
        env="HIVENET_ROUTER_GRPC_MAX_CONNS",
        help="Most connections to the agent authentication port in all (each holds three "
        "descriptors); lowered to fit the open-files limit",
    )
    grpc_conn_timeout: float = duration_option(
        10.0,
        flag="--grpc-conn-timeout",
        env="HIVENET_ROUTER_GRPC_CONN_TIMEOUT",
        help="Time a connection to the agent authentication port has to finish TLS, and "
        "then again to make its call, else it is closed",
    )
    metrics_max_conns_per_ip: int = option(
        16,
        parse=v.positive_int,
        flag="--metrics-max-conns-per-ip",
        env="HIVENET_ROUTER_METRICS_MAX_CONNS_PER_IP",
        help="Most connections to the metrics port from one IPv4 address or IPv6 /56",
    )
    metrics_max_conns: int = option(
        64,
        parse=v.positive_int,
        flag="--metrics-max-conns",
        env="HIVENET_ROUTER_METRICS_MAX_CONNS",
        help="Most connections to the metrics port in all; lowered to fit the open-files limit",
    )
    p2p_handshake_timeout: float = duration_option(
        10.0,
        flag="--p2p-handshake-timeout",
        env="HIVENET_ROUTER_P2P_HANDSHAKE_TIMEOUT",
        help="Time an agent connection has to finish TLS and open its link, else it is closed",
    )
