"""The Valkey harness itself: a real site comes up, fails over, and a proxy partitions it."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import valkey

from tests.valkey_site import FaultProxy, ValkeySite, command, valkey_bin

pytestmark = pytest.mark.timeout(60)


def test_the_wheel_ships_server_and_cli() -> None:
    assert (valkey_bin() / "valkey-server").is_file()
    assert (valkey_bin() / "valkey-cli").is_file()


def test_a_full_site_starts_and_replicates(tmp_path: Path) -> None:
    began = time.monotonic()
    with ValkeySite(tmp_path) as site:
        took = time.monotonic() - began
        print(f"\nsite of 1 primary, 2 replicas and 3 Sentinels ready in {took:.2f}s")
        assert site.master_name == "hivenet"
        assert len(site.sentinel_addrs) == 3
        replicas = site.replica_addrs
        assert len(replicas) == 2 and site.primary_addr not in replicas
        assert site.command(site.primary_addr, "SET", "greeting", "hello") is True
        assert site.command(site.primary_addr, "WAIT", "2", "2000") == 2
        for addr in replicas:
            assert site.command(addr, "GET", "greeting") == "hello"
        for addr in site.sentinel_addrs:
            answer = site.command(addr, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", "hivenet")
            assert isinstance(answer, list) and ":".join(answer) == site.primary_addr
    assert all(not node.alive for node in (*site.data_nodes, *site.sentinel_nodes))


def test_killing_the_primary_promotes_a_replica(tmp_path: Path) -> None:
    with ValkeySite(tmp_path) as site:
        site.command(site.primary_addr, "SET", "kept", "yes")
        assert site.command(site.primary_addr, "WAIT", "2", "2000") == 2
        replicas = site.replica_addrs
        began = time.monotonic()
        old = site.kill_primary()
        new = site.wait_for_new_primary(old, timeout=15)
        took = time.monotonic() - began
        print(f"\nprimary {old} killed; Sentinels agree on {new} after {took:.2f}s")
        assert new != old and new in replicas
        assert site.primary_addr == new
        assert site.command(new, "GET", "kept") == "yes"
        assert site.command(new, "SET", "after", "failover") is True


def test_a_single_primary_restarts_with_its_data_and_flushes(tmp_path: Path) -> None:
    with ValkeySite(tmp_path, replicas=0, sentinels=0, appendonly=True, password="s3cret") as site:
        assert site.sentinel_addrs == [] and site.replica_addrs == []
        with pytest.raises(valkey.AuthenticationError):
            command(site.primary_addr, "PING")
        site.command(site.primary_addr, "SET", "total", "42")
        site.restart(site.primary_node)
        assert site.command(site.primary_addr, "GET", "total") == "42"
        site.flushall()
        assert site.command(site.primary_addr, "DBSIZE") == 0


def test_a_fault_proxy_partitions_and_heals(tmp_path: Path) -> None:
    with (
        ValkeySite(tmp_path, replicas=0, sentinels=0) as site,
        FaultProxy(site.primary_addr) as proxy,
        site.client(proxy.addr, timeout=0.5) as client,
    ):
        assert client.ping() is True
        proxy.cut()
        # The open connection is aborted, and the new one is accepted and held silent.
        began = time.monotonic()
        with pytest.raises((valkey.ConnectionError, valkey.TimeoutError)):
            client.ping()
        with pytest.raises(valkey.TimeoutError):
            client.ping()
        assert time.monotonic() - began < 3
        assert proxy.connections >= 1
        proxy.restore()
        assert client.ping() is True
