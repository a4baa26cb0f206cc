"""A real local Redis Cluster for the tests: three masters with one replica each (six redis-server processes),
created with `redis-cli --cluster create`; a master can be killed to see its replica promoted."""

from __future__ import annotations

import functools
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from loadtests.processes import free_port
from tests.redis_server import answers_ping, redis_server_binary


def _port_with_room_for_its_bus() -> int:
    """A free port below 55536: each node also listens on port + 10000 (the cluster bus)."""
    for _ in range(1000):
        port = free_port()
        if port < 55536:
            return port
    raise RuntimeError("no free port below 55536")


class RedisCluster:
    def __init__(self, root: Path, node_timeout_ms: int = 1000) -> None:
        self.root, self.node_timeout_ms = root, node_timeout_ms
        self.ports = [_port_with_room_for_its_bus() for _ in range(6)]
        self.processes: dict[int, subprocess.Popen[bytes]] = {}

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def start(self) -> RedisCluster:
        binary = redis_server_binary()
        for port in self.ports:
            node = self.root / f"node-{port}"
            node.mkdir(parents=True, exist_ok=True)
            cmd = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                   "--cluster-enabled", "yes", "--cluster-config-file", str(node / "nodes.conf"),
                   "--cluster-node-timeout", str(self.node_timeout_ms), "--dir", str(node),
                   # A replica's first sync at once (the default waits 5 s for more replicas to share it)
                   "--repl-diskless-sync-delay", "0"]  # fmt: skip
            with (node / "log").open("ab") as log:
                self.processes[port] = subprocess.Popen(
                    cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
        for port in self.ports:
            self._until(functools.partial(answers_ping, port), f"node {port} answers")
        cli = shutil.which("redis-cli") or "redis-cli"
        create = [
            cli,
            "--cluster",
            "create",
            *(f"127.0.0.1:{p}" for p in self.ports),
            "--cluster-replicas",
            "1",
            "--cluster-yes",
        ]
        subprocess.run(create, check=True, capture_output=True, timeout=60)
        self._until(self.healthy, "the cluster is ok")
        # A replica that has never synced with its master will not take over from it: wait for every link.
        self._until(self.replicas_synced, "every replica synced")
        return self

    def replicas_synced(self) -> bool:
        infos = [self.info(p, "info", "replication") for p, proc in self.processes.items() if proc.poll() is None]
        replicas = [i for i in infos if "role:slave" in i]
        return len(replicas) == len(self.ports) // 2 and all("master_link_status:up" in i for i in replicas)

    def info(self, port: int, *command: str) -> str:
        cli = shutil.which("redis-cli") or "redis-cli"
        result = subprocess.run([cli, "-p", str(port), *command], capture_output=True, text=True, timeout=10)
        return result.stdout

    def healthy(self) -> bool:
        alive = [p for p, proc in self.processes.items() if proc.poll() is None]
        return bool(alive) and all("cluster_state:ok" in self.info(p, "cluster", "info") for p in alive)

    def masters(self) -> list[int]:
        return [
            p
            for p, proc in self.processes.items()
            if proc.poll() is None and "role:master" in self.info(p, "info", "replication")
        ]

    def keyslot(self, key: str) -> int:
        """The slot Redis itself computes for ``key`` (CLUSTER KEYSLOT: hash tags included)."""
        alive = next(p for p, proc in self.processes.items() if proc.poll() is None)
        return int(self.info(alive, "cluster", "keyslot", key))

    def master_of(self, slot: int) -> int | None:
        """The port of the master serving ``slot`` as a live node's CLUSTER NODES says, if its process is alive
        (right after a kill the others still name the dead master until they agree it failed)."""
        alive = next(p for p, proc in self.processes.items() if proc.poll() is None)
        for line in self.info(alive, "cluster", "nodes").splitlines():
            _, address, flags, *_ = line.split()[:8]
            if "master" not in flags.split(","):
                continue
            for served in line.split()[8:]:
                if served.startswith("["):  # a slot being migrated: none here
                    continue
                low, _, high = served.partition("-")
                if int(low) <= slot <= int(high or low):
                    port = int(address.split("@")[0].rsplit(":", 1)[1])
                    return port if self.processes[port].poll() is None else None
        return None

    def wait_master(self, slot: int) -> int:
        """Wait until a live node serves ``slot`` and the cluster is ok; that node's port. After a kill: the dead
        master's replica, once promoted. Right after start-up too: the node asked may not have heard every slot's
        assignment yet (CLUSTER NODES then names no master for it: one fresh-clone CI run saw that)."""
        self._until(lambda: self.master_of(slot) is not None, f"a live master for slot {slot}")
        self.wait_healthy()
        port = self.master_of(slot)
        assert port is not None
        return port

    def kill(self, port: int) -> None:
        process = self.processes[port]
        process.kill()
        process.wait(timeout=10)

    def wait_healthy(self) -> None:
        """Every live node says cluster_state:ok. Right after a kill they still do (the failure is not detected
        yet): wait for the failover with ``wait_master``."""
        self._until(self.healthy, "the cluster is ok again")

    @staticmethod
    def _until(condition: Callable[[], bool], what: str, attempts: int = 300) -> None:
        for _ in range(attempts):
            if condition():
                return
            time.sleep(0.05)
        raise RuntimeError(f"redis cluster: never {what}")

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.kill()
                process.wait(timeout=10)

    def __enter__(self) -> RedisCluster:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
