"""Local Redis servers (and a Redis Cluster) for `jobtier run` and for the tests.

They run as child processes from the installed binaries, with their data in a folder of the
caller's choosing and on loopback ports. Nothing here is used in production deployments.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path


def free_port(below: int = 65536) -> int:
    """A free loopback port under ``below`` (a cluster node also needs port + 10000)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port < below:
            return port
    raise RuntimeError(f"no free port below {below}")


def wait_port(
    port: int, timeout: float = 15.0, proc: subprocess.Popen[bytes] | None = None
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server on port {port} exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.02)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout}s")


def redis_server_binary() -> str:
    path = shutil.which("redis-server")
    if not path:
        raise RuntimeError(
            "redis-server is not installed: `apt-get install redis-server` (make run/test do it)"
        )
    return path


class LocalRedis:
    """One redis-server with AOF on and a non-evicting policy, as jobtier requires."""

    def __init__(self, folder: Path, port: int | None = None, *, cluster: bool = False) -> None:
        self.folder = Path(folder)
        self.port = port or free_port(55536 if cluster else 65536)
        self.cluster = cluster
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> LocalRedis:
        self.folder.mkdir(parents=True, exist_ok=True)
        args = [
            redis_server_binary(),
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.folder),
            "--appendonly", "yes",
            "--appendfsync", "everysec",
            "--save", "",
            "--maxmemory-policy", "noeviction",
            "--protected-mode", "no",
            "--daemonize", "no",
            "--logfile", str(self.folder / "redis.log"),
        ]  # fmt: skip
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, start_new_session=True)
        wait_port(self.port, proc=self.proc)
        return self

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def restart(self) -> None:
        """Stop (SIGTERM: Redis flushes its AOF) and start again on the same port and data."""
        self.stop()
        self.start()


class LocalCluster:
    """A Redis Cluster of ``masters`` primaries (no replicas) on loopback."""

    def __init__(self, folder: Path, masters: int = 3) -> None:
        self.folder = Path(folder)
        self.nodes = [LocalRedis(self.folder / f"node{i}", cluster=True) for i in range(masters)]

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def start(self) -> LocalCluster:
        for node in self.nodes:
            node.start()
        cli = shutil.which("redis-cli")
        if not cli:
            raise RuntimeError("redis-cli is not installed (package redis-tools)")
        addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
        subprocess.run(
            [cli, "--cluster", "create", *addrs, "--cluster-replicas", "0", "--cluster-yes"],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            out = subprocess.run(
                [cli, "-p", str(self.nodes[0].port), "cluster", "info"],
                capture_output=True,
                text=True,
            ).stdout
            if "cluster_state:ok" in out:
                return self
            time.sleep(0.1)
        raise TimeoutError("the local cluster did not reach cluster_state:ok")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


def terminate(proc: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
    """SIGTERM a child's whole process group, SIGKILL after ``timeout``."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
