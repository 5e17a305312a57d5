"""What `hivenet-router` refuses at start: options that parse one by one but not together,
and values whose shape a single parser does not judge (names, origins, addresses). Each
refusal names the option to change."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from hivenet_router.config import values as v
from hivenet_router.config.options import ConfigError
from hivenet_router.config.shared import check_log_format

if TYPE_CHECKING:
    from hivenet_router.config.router import RouterConfig

_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
_WILDCARDS = frozenset({"", "0.0.0.0", "::", "[::]", "*"})
_ORIGIN = re.compile(r"https?://(\[[0-9a-fA-F:.]+\]|[^/\s:\[\]]+)(:\d{1,5})?")


def check(cfg: RouterConfig) -> None:
    """Raise ConfigError for the first thing wrong with `cfg`."""
    if cfg.session_ttl <= cfg.session_renew_margin:
        raise ConfigError(
            "--session-ttl must be longer than --session-renew-margin "
            f"({cfg.session_renew_margin:g}s): agents renew that long before expiry"
        )
    if not cfg.heartbeat_interval < cfg.unhealthy_after < cfg.remove_after:
        raise ConfigError(
            "--heartbeat-interval < --unhealthy-after < --remove-after must hold "
            f"(got {cfg.heartbeat_interval:g}s, {cfg.unhealthy_after:g}s, "
            f"{cfg.remove_after:g}s)"
        )
    check_log_format(cfg.log_format)
    _check_sync(cfg)
    if cfg.ledger_dsn and "wallet" not in cfg.stages:
        # The DSN promises wallets for every tenant: serving unbilled instead, because
        # the stage list left the wallet out, must not go unnoticed.
        raise ConfigError(
            "--ledger-dsn turns wallets on, but HIVENET_ROUTER_STAGES "
            f"({','.join(cfg.stages)}) does not list wallet: add it before cache and "
            "validator, or unset --ledger-dsn"
        )
    if cfg.admit_fraction <= 0:
        raise ConfigError("HIVENET_ROUTER_ADMIT_FRACTION must be above 0 (and at most 1)")
    for origin in cfg.cors_allowed_origins:
        if origin != "*" and not _ORIGIN.fullmatch(origin):
            raise ConfigError(
                f"--cors-allowed-origins: {origin!r} is not an origin "
                "(scheme://host[:port], no path) or *"
            )
    if cfg.rpm_burst_seconds >= 60:
        raise ConfigError("HIVENET_ROUTER_RPM_BURST_SECONDS must be below 60")


def _check_sync(cfg: RouterConfig) -> None:
    if cfg.sync_store not in {"", "valkey"}:
        raise ConfigError(f"--sync-store must be valkey or empty, not {cfg.sync_store!r}")
    for flag, name in (
        ("--sync-site", cfg.sync_site),
        ("--site-id", cfg.site_id),
        ("--router-id", cfg.router_id),
    ):
        if name and not _NAME.fullmatch(name):
            raise ConfigError(f"{flag} {name!r}: use 1 to 64 letters, digits, '.', '_' or '-'")
    if cfg.advertise_grpc_addr:
        _check_advertised(cfg.advertise_grpc_addr)
    if not cfg.sync_store:
        return
    if cfg.quota_backend == "badger":
        raise ConfigError(
            "--sync-store=valkey replaces HIVENET_ROUTER_QUOTA_BACKEND=badger (the store "
            "keeps today's totals); unset one of them"
        )
    if sum(map(bool, (cfg.sync_addr, cfg.sync_sentinels, cfg.sync_cluster))) != 1:
        raise ConfigError(
            "--sync-store=valkey needs exactly one of --sync-addr HOST:PORT, "
            "--sync-sentinels HOST:PORT,... or --sync-cluster HOST:PORT,..."
        )
    named = (
        [("--sync-addr", cfg.sync_addr)]
        + [("--sync-sentinels", a) for a in cfg.sync_sentinels]
        + [("--sync-cluster", a) for a in cfg.sync_cluster]
    )
    for flag, address in named:
        if address:
            try:
                v.host_port(address)
            except ValueError as error:
                raise ConfigError(f"{flag}: {error}") from None


def _check_advertised(address: str) -> None:
    """An address agents can dial: a host (not a wildcard) and a port."""
    host, sep, _ = address.rpartition(":")
    if not sep or host.strip("[]") in _WILDCARDS or host in _WILDCARDS:
        raise ConfigError(
            f"--advertise-grpc-addr {address!r}: give the host and port agents dial "
            "(example: router-0.router-headless:50051), not a bare port or a wildcard address"
        )
    try:
        v.host_port(address)
    except ValueError as error:
        raise ConfigError(f"--advertise-grpc-addr: {error}") from None
