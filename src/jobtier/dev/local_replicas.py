"""Replicated local Redis for the tests and benches; never for production: a Redis Cluster
(masters, each with replicas) and a Sentinel set (a master, its replicas and the sentinels
that fail it over), with what a failover test needs: kill a master, wait for the promotion,
bring the killed node back as a replica.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import redis as syncredis

from jobtier.dev.local_redis import (
    CLUSTER_BUS_OFFSET,
    LocalRedis,
    conf_quoted,
    connect_to,
    free_port,
    redis_server_binary,
    wait_port,
    write_private,
)
from jobtier.dev.procs import stop_child, tied

T = TypeVar("T")


class LocalCluster:
    """A Redis Cluster of ``masters`` primaries, each with ``replicas`` replicas, on loopback.

    For failover tests: ``kill`` a master (SIGKILL, as its host dying), ``wait_promoted`` for
    the cluster to promote its replica, ``revive`` the killed node (it rejoins as a replica of
    the promoted one). ``node_timeout_ms`` is ``cluster-node-timeout``: how long a silent
    master goes before its replicas may take over (Redis's default is 15 s).

    ``tls``: every node also serves TLS on a port of its own (``tls_ports``), and the nodes
    speak it among themselves (the cluster bus on that port + 10000, replication). A client
    on a TLS port is told the others' TLS ports (CLUSTER SLOTS), one on a plain port their
    plain ones, which is what the helpers here use.

    A node's ``requirepass`` (``node.options``, the same on every node, with ``masterauth``
    for replication) is given by this class's own connections and by ``redis-cli``."""

    def __init__(
        self,
        folder: Path,
        masters: int = 3,
        *,
        replicas: int = 0,
        node_timeout_ms: int = 15000,
        tls: TlsFiles | None = None,
    ) -> None:
        self.folder = Path(folder)
        self.replicas = replicas
        self.tls = tls
        options: dict[str, int | str] = {"cluster-node-timeout": node_timeout_ms}
        if replicas:
            # a replica serves no reads here (jobtier reads its masters); one that lost its
            # master for long still takes over, as a production cluster's would. The other
            # masters keep serving their slots while one is down (with full coverage
            # required, every node answers CLUSTERDOWN until its replica is promoted)
            options |= {
                "cluster-replica-validity-factor": 0,
                "cluster-require-full-coverage": "no",
            }
        # a node's ports are told to the others only once it started: one taken before is
        # chosen again
        self.nodes = [
            LocalRedis(self.folder / f"node{i}", cluster=True, options=options, free_ports=True)
            for i in range(masters * (1 + replicas))
        ]
        if tls is not None:
            for node in self.nodes:
                port = free_port(65536 - CLUSTER_BUS_OFFSET, also=CLUSTER_BUS_OFFSET)
                node.options |= {"tls-cluster": "yes", **tls.server_options(port)}
        self._killed_slot: dict[int, int | None] = {}

    @property
    def tls_ports(self) -> list[int]:
        """The nodes' TLS ports (with ``tls``; final once the cluster has started)."""
        if self.tls is None:
            return []
        return [int(node.options["tls-port"]) for node in self.nodes]

    @property
    def url(self) -> str:
        """A client's URL: the first node's (its TLS port, with ``tls`` the CA to trust);
        final once the cluster has started (a node's port found taken is chosen again)."""
        if self.tls is not None:
            return self.tls.url(self.tls_ports[0])
        return self.nodes[0].url

    def start(self) -> LocalCluster:
        """Start the nodes and make them a cluster; on any failure the nodes already started
        are stopped before the error is raised (none is left running)."""
        try:
            cli = shutil.which("redis-cli")
            if not cli:
                raise RuntimeError("redis-cli is not installed (package redis-tools)")
            for node in self.nodes:
                node.start()
            # with TLS, met on their TLS ports: the cluster bus is on that port + 10000
            ports = self.tls_ports or [n.port for n in self.nodes]
            tls = ["--tls", "--cacert", str(self.tls.ca)] if self.tls is not None else []
            # the password in the environment: ``-a`` would warn that it shows in ps
            password = self.nodes[0].password
            auth = {"REDISCLI_AUTH": password} if password else {}
            subprocess.run(
                [
                    cli,
                    *tls,
                    "--cluster",
                    "create",
                    *(f"127.0.0.1:{port}" for port in ports),
                    "--cluster-replicas",
                    str(self.replicas),
                    "--cluster-yes",
                ],
                check=True,
                stdout=subprocess.DEVNULL,
                env={**os.environ, **auth},
            )
            self.wait_ok()
            if self.replicas:
                self.wait_replicated()
        except BaseException:
            self.stop()
            raise
        return self

    def running(self) -> list[LocalRedis]:
        return [node for node in self.nodes if node.pid is not None]

    def roles(self) -> dict[int, tuple[str, int | None]]:
        """Port -> (``master`` or ``replica``, the master's port for a replica), as the
        running nodes see it (from CLUSTER NODES of one of them)."""
        for node in self.running():
            try:
                return _cluster_roles(node)
            except syncredis.RedisError:
                continue
        raise RuntimeError("no node of the local cluster answers")

    def masters(self) -> list[LocalRedis]:
        """The running nodes that are masters now."""
        roles = self.roles()
        return [n for n in self.running() if roles.get(n.port, ("", None))[0] == "master"]

    def replicas_of(self, master: LocalRedis) -> list[LocalRedis]:
        roles = self.roles()
        return [n for n in self.running() if roles.get(n.port) == ("replica", master.port)]

    def master_of_slot(self, slot: int) -> LocalRedis:
        """The node that serves ``slot`` now."""
        for node in self.running():
            try:
                with node.client() as client:
                    for first, last, main, *_ in client.execute_command("CLUSTER", "SLOTS"):
                        if first <= slot <= last:
                            port = int(main[1])
                            return next(n for n in self.nodes if n.port == port)
            except syncredis.RedisError:
                continue
        raise RuntimeError(f"no node of the local cluster serves slot {slot}")

    def kill(self, node: LocalRedis) -> None:
        """SIGKILL ``node``, as if its host died: no AOF flush, no goodbye to the others."""
        self._killed_slot[node.port] = self.slot_of(node)
        node.stop(signal.SIGKILL)

    def slot_of(self, node: LocalRedis) -> int | None:
        """A slot ``node`` serves (None for a replica)."""
        with node.client() as client:
            for first, _last, main, *_ in client.execute_command("CLUSTER", "SLOTS"):
                if int(main[1]) == node.port:
                    return int(first)
        return None

    def wait_promoted(self, killed: LocalRedis, timeout: float = 30.0) -> LocalRedis:
        """After ``kill`` of a master: wait until another node serves its slots and every
        running node reports ``cluster_state:ok``; return that node (its promoted replica)."""
        slot = self._killed_slot.get(killed.port)
        if slot is None:
            raise ValueError(f"node {killed.port} was not a master when it was killed")

        def promoted() -> LocalRedis | None:
            node = self.master_of_slot(slot)
            ok = node is not killed and all(_cluster_ok(n) for n in self.running())
            return node if ok else None

        failure = f"no replica of the killed master {killed.port} took over within {timeout:g}s"
        return poll(promoted, timeout, failure)

    def revive(self, node: LocalRedis, timeout: float = 30.0) -> None:
        """Start a killed node again on its port and data: it rejoins as a replica of the
        master that took its slots; return once it replicates with its link up."""
        node.start()
        _wait_replicating(node, timeout)
        self.wait_ok(timeout)

    def wait_replicated(self, timeout: float = 30.0) -> None:
        """Return once every master has its replicas attached with their links up."""
        poll(
            lambda: all(len(_replicas_online(m)) >= self.replicas for m in self.masters()),
            timeout,
            f"the local cluster's replicas did not attach in {timeout:g}s",
        )

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Return once every running node reports ``cluster_state:ok``: each turns ok on its
        own, some time after it started, and answers keyed commands with CLUSTERDOWN until
        then (which a client pipeline does not retry)."""
        waiting = self.running()
        deadline = time.monotonic() + timeout
        while True:
            waiting = [node for node in waiting if not _cluster_ok(node)]
            if not waiting:
                return
            if time.monotonic() > deadline:
                ports = ", ".join(str(node.port) for node in waiting)
                raise TimeoutError(
                    f"the local cluster's nodes on ports {ports} did not reach "
                    f"cluster_state:ok within {timeout:g}s; see their redis.log"
                )
            time.sleep(0.05)

    def stop(self) -> None:
        """Stop every node, even when stopping one of them fails (the first error is raised
        once all were tried)."""
        _stop_all(self.nodes)


def _stop_all(nodes: list[LocalRedis]) -> None:
    errors: list[BaseException] = []
    for node in nodes:
        try:
            node.stop()
        except BaseException as exc:  # the others are stopped, then it is raised
            errors.append(exc)
    if errors:
        raise errors[0]


def _wait_replicating(node: LocalRedis, timeout: float) -> None:
    """Return once ``node`` is a replica with its link to its master up."""

    def replicating() -> bool:
        with node.client(decode_responses=True) as client:
            info = client.info("replication")
        return bool(info.get("role") == "slave" and info.get("master_link_status") == "up")

    poll(replicating, timeout, f"node {node.port} did not rejoin as a replica in {timeout:g}s")


def poll(check: Callable[[], T | None], timeout: float, failure: str, interval: float = 0.05) -> T:
    """``check()`` every ``interval`` seconds until it returns a true value, which is returned;
    a node that refuses or errs meanwhile (RedisError, RuntimeError) counts as not yet.
    Past ``timeout`` seconds: ``TimeoutError(failure)``."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            got = check()
            if got:
                return got
        except (RuntimeError, syncredis.RedisError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(failure)
        time.sleep(interval)


def _cluster_roles(node: LocalRedis) -> dict[int, tuple[str, int | None]]:
    """CLUSTER NODES of ``node``, as port -> (role, master's port)."""
    with node.client(decode_responses=True) as client:
        text = client.execute_command("CLUSTER", "NODES")
    if isinstance(text, dict):  # redis-py parses the reply into {address: fields}
        lines = [f"{v['node_id']} {addr} {v['flags']} {v['master_id']}" for addr, v in text.items()]
    else:
        lines = str(text).splitlines()
    ids: dict[str, int] = {}
    parsed = []
    for line in lines:
        node_id, addr, flags, master_id = line.split()[:4]
        port_of = int(addr.split("@")[0].rsplit(":", 1)[1])
        ids[node_id] = port_of
        parsed.append((port_of, flags.split(","), master_id))
    roles: dict[int, tuple[str, int | None]] = {}
    for port_of, flag_list, master_id in parsed:
        if "fail" in flag_list or "fail?" in flag_list or "noaddr" in flag_list:
            continue
        if "master" in flag_list:
            roles[port_of] = ("master", None)
        elif "slave" in flag_list:
            roles[port_of] = ("replica", ids.get(master_id))
    return roles


def _replicas_online(master: LocalRedis) -> list[int]:
    """The ports of the replicas attached to ``master`` with their links up (the ports they
    announce: their TLS ones under ``tls-replication``)."""
    with master.client(decode_responses=True) as client:
        info = client.info("replication")
    ports = []
    for key, value in info.items():
        if key.startswith("slave") and isinstance(value, dict) and value.get("state") == "online":
            ports.append(int(value["port"]))
    return ports


@dataclass(frozen=True)
class TlsFiles:
    """A server certificate and its key, and the CA that signed it (PEM files)."""

    ca: Path
    cert: Path
    key: Path

    def server_options(self, port: int) -> dict[str, int | str | Path]:
        """What a redis-server (or sentinel) needs to serve TLS on ``port`` and speak it to
        the others; clients need no certificate of their own."""
        return {
            "tls-port": port,
            "tls-cert-file": self.cert,
            "tls-key-file": self.key,
            "tls-ca-cert-file": self.ca,
            "tls-auth-clients": "no",
            "tls-replication": "yes",
        }

    def url(self, port: int) -> str:
        """A client's URL for the TLS server on ``port``, trusting this CA."""
        return f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={self.ca}"


class LocalSentinels:
    """One master, ``replicas`` replicas and ``count`` Sentinels watching them, on loopback:
    the single-master deployment that fails over (JOBTIER_REDIS_SENTINELS).

    ``down_after_ms`` is how long the sentinels wait before they call a silent master down;
    ``failover_timeout_ms`` bounds a failover attempt (a second one waits twice that).

    ``tls``: every server and sentinel also serves TLS on a port of its own, and they speak
    it among themselves (replication, the sentinels' watch and their hellos), so the
    sentinels name the TLS ports: ``addresses`` and ``url`` are then a TLS client's. The
    plain ports stay, for this class's own checks.

    A node's ``requirepass`` (``node.options``, the same on every node, with ``masterauth``
    for replication) is given by this class's own connections and by the sentinels
    (``auth-pass``); the sentinels themselves ask for none."""

    def __init__(
        self,
        folder: Path,
        *,
        name: str = "jobtier",
        replicas: int = 1,
        count: int = 3,
        down_after_ms: int = 2000,
        failover_timeout_ms: int = 4000,
        tls: TlsFiles | None = None,
    ) -> None:
        self.folder = Path(folder)
        self.name = name
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms
        self.tls = tls
        self.nodes = [LocalRedis(self.folder / f"redis{i}") for i in range(replicas + 1)]
        # the port the others reach a node on (its TLS port with ``tls``)
        self.served = {node.port: free_port() if tls else node.port for node in self.nodes}
        if tls is not None:
            for node in self.nodes:
                node.options |= tls.server_options(self.served[node.port])
        for node in self.nodes[1:]:
            node.options["replicaof"] = ("127.0.0.1", self.served[self.nodes[0].port])
        self.sentinel_ports = [free_port() for _ in range(count)]
        self.sentinel_tls_ports = [free_port() for _ in range(count)] if tls else []
        self.sentinels: list[subprocess.Popen[bytes]] = []

    @property
    def addresses(self) -> str:
        """JOBTIER_REDIS_SENTINELS for this set."""
        ports = self.sentinel_tls_ports or self.sentinel_ports
        return ",".join(f"127.0.0.1:{port}" for port in ports)

    @property
    def url(self) -> str:
        """JOBTIER_REDIS_URL beside it: the database (the host is the sentinels' answer), and
        with ``tls`` the CA to trust."""
        if self.tls is not None:
            return self.tls.url(6379)
        return "redis://127.0.0.1:6379/0"

    def start(self) -> LocalSentinels:
        try:
            for node in self.nodes:
                node.start()
            for i, port in enumerate(self.sentinel_ports):
                self.sentinels.append(self._start_sentinel(i, port))
            for port in self.sentinel_ports:
                wait_port(port)
            self.wait_replicated()
            self.wait_sentinels()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_sentinel(self, i: int, port: int) -> subprocess.Popen[bytes]:
        folder = self.folder / f"sentinel{i}"
        folder.mkdir(parents=True, exist_ok=True)
        # its own folder only: a sentinel rewrites its file at start (umask's mode), and the
        # file holds the master's password
        folder.chmod(0o700)
        conf = folder / "sentinel.conf"  # a sentinel rewrites its file: it must be its own
        master = self.served[self.nodes[0].port]
        tls = ""
        if self.tls is not None:
            options = self.tls.server_options(self.sentinel_tls_ports[i])
            tls = "".join(f"{name} {value}\n" for name, value in options.items())
        password = self.nodes[0].password
        auth = f"sentinel auth-pass {self.name} {conf_quoted(password)}\n" if password else ""
        write_private(
            conf,
            f"port {port}\nbind 127.0.0.1\ndir {folder}\nprotected-mode no\n"
            f"logfile {folder / 'sentinel.log'}\n{tls}"
            f"sentinel monitor {self.name} 127.0.0.1 {master} 2\n"
            f"sentinel down-after-milliseconds {self.name} {self.down_after_ms}\n"
            f"sentinel failover-timeout {self.name} {self.failover_timeout_ms}\n"
            f"sentinel parallel-syncs {self.name} 1\n{auth}",
        )
        args = [redis_server_binary(), str(conf), "--sentinel"]
        return subprocess.Popen(
            tied(args, signal.SIGTERM), stdin=subprocess.DEVNULL, start_new_session=True
        )

    def master(self) -> LocalRedis:
        """The node the sentinels name master now."""
        return self._node(self._sentinel_master_port())

    def _node(self, served: int) -> LocalRedis:
        """The node the others reach on port ``served``."""
        return next(n for n in self.nodes if self.served[n.port] == served)

    def _sentinel_master_port(self) -> int:
        for port in self.sentinel_ports:
            try:
                with connect_to(port, 2.0, decode_responses=True) as client:
                    reply = client.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.name)
                if reply:
                    return int(reply[1])
            except syncredis.RedisError:
                continue
        raise RuntimeError("no sentinel answers")

    def kill(self, node: LocalRedis) -> None:
        node.stop(signal.SIGKILL)

    def wait_promoted(self, killed: LocalRedis, timeout: float = 30.0) -> LocalRedis:
        """After ``kill`` of the master: wait until the sentinels name another node master and
        that node has taken the role; return it."""

        def promoted() -> LocalRedis | None:
            node = self._node(self._sentinel_master_port())
            if node is killed:
                return None
            with node.client(decode_responses=True) as client:
                if client.info("replication").get("role") != "master":
                    return None
            return node

        return poll(promoted, timeout, f"the sentinels promoted no replica within {timeout:g}s")

    def revive(self, node: LocalRedis, timeout: float = 30.0) -> None:
        """Start a killed node again, as a replica of the master the sentinels promoted (as
        an operator brings a failed host back); return once it replicates with its link up."""
        node.options["replicaof"] = ("127.0.0.1", self.served[self.master().port])
        node.start()
        _wait_replicating(node, timeout)

    def wait_replicated(self, timeout: float = 30.0) -> None:

        def attached() -> bool:
            master = self.nodes[0] if not self.sentinels else self.master()
            return len(_replicas_online(master)) >= len(self.nodes) - 1

        poll(attached, timeout, f"the replicas did not attach within {timeout:g}s")

    def wait_sentinels(self, timeout: float = 30.0) -> None:
        """Return once every sentinel knows the master, its replicas and the other sentinels
        (only then can they agree on a failover)."""
        deadline = time.monotonic() + timeout
        want_sentinels, want_replicas = len(self.sentinel_ports) - 1, len(self.nodes) - 1
        while True:
            ready = 0
            for port in self.sentinel_ports:
                try:
                    with connect_to(port, 2.0, decode_responses=True) as client:
                        state = client.execute_command("SENTINEL", "MASTER", self.name)
                    # redis-py parses this reply into a dict (with int values)
                    fields = (
                        state
                        if isinstance(state, dict)
                        else dict(zip(state[::2], state[1::2], strict=True))
                    )
                    if (
                        int(fields.get("num-other-sentinels", 0)) >= want_sentinels
                        and int(fields.get("num-slaves", 0)) >= want_replicas
                    ):
                        ready += 1
                except (syncredis.RedisError, TypeError, ValueError):
                    pass
            if ready == len(self.sentinel_ports):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"the sentinels did not find each other within {timeout:g}s")
            time.sleep(0.1)

    def stop(self) -> None:
        sentinels, self.sentinels = self.sentinels, []
        for proc in sentinels:
            stop_child(proc, signal.SIGTERM)
        for node in self.nodes:
            node.stop()


def _cluster_ok(node: LocalRedis) -> bool:
    client = node.client()
    try:
        info = client.execute_command("CLUSTER", "INFO")  # type: ignore[no-untyped-call]
    except syncredis.RedisError:
        return False
    finally:
        client.close()
    return b"cluster_state:ok" in info
