"""Local Redis servers (and a Redis Cluster) for `jobtier run` and the tests; never for
production. They run from the installed binaries, data in a folder of the caller's choosing,
on loopback ports, tied to the process that started them (``jobtier.dev.procs``).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis as syncredis

from jobtier.dev.procs import leftover, process_cwd, stop_child, tied

log = logging.getLogger("jobtier.dev")

LOCAL_CONF = "redis.local.conf"  # optional, in the data folder: the user's own settings
CLUSTER_BUS_OFFSET = 10000  # a cluster node also listens on its port + this (the bus)


def free_port(below: int = 65536, *, also: int = 0) -> int:
    """A free loopback port under ``below``; with ``also``, port + ``also`` is free too (a
    cluster node's bus port: taken, the node exits at start)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port < below and (not also or _bindable(port + also)):
            return port
    raise RuntimeError(f"no free port below {below}")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


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


def _connect(port: int, timeout: float = 5.0, **options: Any) -> syncredis.Redis:
    return syncredis.Redis(
        host="127.0.0.1", port=port, socket_timeout=timeout, socket_connect_timeout=2, **options
    )


def redis_server_binary() -> str:
    path = shutil.which("redis-server")
    if not path:
        raise RuntimeError(
            "redis-server is not installed: `apt-get install redis-server` (make run/test do it)"
        )
    return path


class LocalRedis:
    """One redis-server with AOF on and a non-evicting policy, as jobtier requires.

    ``redis.local.conf`` in the data folder, when present, is included first: the user's own
    settings for a development Redis (memory limits, logging); the ones jobtier needs (port,
    folder, AOF, no eviction) come after it on the command line and win.
    """

    def __init__(
        self,
        folder: Path,
        port: int | None = None,
        *,
        cluster: bool = False,
        options: dict[str, Any] | None = None,
    ) -> None:
        self.folder = Path(folder).absolute()
        self.port = port or (
            free_port(65536 - CLUSTER_BUS_OFFSET, also=CLUSTER_BUS_OFFSET)
            if cluster
            else free_port()
        )
        self.cluster = cluster
        self.options = dict(options or {})  # more server options (a replica's replicaof, ...)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pidfile(self) -> Path:
        return self.folder / "redis.pid"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    def start(self, *, loaded: bool = True) -> LocalRedis:
        """Start it and return once it answers commands (after loading its AOF, however long
        that takes: progress is logged as ``local_redis_loading``); ``loaded=False``: once
        it listens (for tests of what clients do while it loads)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        args = [redis_server_binary()]
        if (self.folder / LOCAL_CONF).exists():
            args += ["--include", str(self.folder / LOCAL_CONF)]
        options = {
            "port": self.port,
            "bind": "127.0.0.1",
            "dir": self.folder,
            "appendonly": "yes",
            "appendfsync": "everysec",
            "save": "",
            "maxmemory-policy": "noeviction",
            "protected-mode": "no",
            "daemonize": "no",
            "pidfile": self.pidfile,
            "logfile": self.folder / "redis.log",
        }
        if self.cluster:
            options |= {"cluster-enabled": "yes", "cluster-config-file": "nodes.conf"}
        options |= self.options
        for name, value in options.items():
            values = value if isinstance(value, tuple) else (value,)  # replicaof: (host, port)
            args += [f"--{name}", *map(str, values)]
        # its own session: Ctrl-C reaches `jobtier run`, which stops it after the parts
        self.proc = subprocess.Popen(
            tied(args, signal.SIGTERM), stdin=subprocess.DEVNULL, start_new_session=True
        )
        try:
            wait_port(self.port, proc=self.proc)
            if loaded:
                self.wait_loaded()
        except BaseException:
            self.stop()
            raise
        return self

    def wait_loaded(self, stalled: float = 30.0) -> None:
        """Return once the server answers commands. While it loads its data (it then answers
        only INFO and the like, with ``loading:1``) wait, logging the progress; give up only
        when it neither answers nor progresses for ``stalled`` seconds."""
        client = _connect(self.port)
        deadline = time.monotonic() + stalled
        logged = 0.0
        try:
            while True:
                if self.proc is not None and self.proc.poll() is not None:
                    raise RuntimeError(
                        f"redis-server on port {self.port} exited with {self.proc.returncode}; "
                        f"see {self.folder / 'redis.log'}"
                    )
                try:
                    info = client.info("persistence")
                except (syncredis.ConnectionError, syncredis.TimeoutError):
                    if time.monotonic() > deadline:
                        raise TimeoutError(
                            f"redis-server on port {self.port} does not answer"
                        ) from None
                    time.sleep(0.05)
                    continue
                if not int(info.get("loading", 0)):
                    return
                now = time.monotonic()
                deadline = now + stalled
                if now - logged >= 2.0:
                    logged = now
                    log.info(
                        "event=local_redis_loading port=%d percent=%s: waiting for Redis to "
                        "load its append-only file",
                        self.port,
                        info.get("loading_loaded_perc", "?"),
                    )
                time.sleep(0.1)
        finally:
            client.close()

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stop it (SIGTERM: Redis fsyncs its AOF first)."""
        if self.proc:
            stop_child(self.proc, sig)
        self.proc = None

    def restart(self) -> None:
        """Stop and start again on the same port and data."""
        self.stop()
        self.start()

    def leftover_pid(self) -> int | None:
        """The pid of a redis-server of this folder that we did not start (an earlier run's)."""
        return leftover(self.pidfile, "redis-server", self.folder, self.pid)


@dataclass(frozen=True, slots=True)
class PortOwner:
    """What answers on a loopback port where we wanted to start a server."""

    description: str  # for the user: what we found
    folder: Path | None = None  # its data folder, when it told us
    pid: int | None = None


def redis_at(port: int) -> PortOwner:
    """Ask whatever listens on ``port`` who it is: a Redis, and with which data folder."""
    client = _connect(port, 3.0, decode_responses=True)
    try:
        info = client.info("server")
        pid = int(info.get("process_id", 0)) or None
        version = info.get("redis_version", "?")
        folder: Path | None = None
        try:
            reply = client.config_get("dir").get("dir")
            folder = Path(reply) if reply else None
        except syncredis.RedisError:  # CONFIG renamed or disabled
            folder = process_cwd(pid) if pid else None
        where = f"data folder {folder}" if folder else "a data folder it does not report"
        return PortOwner(f"a Redis {version} (pid {pid}, {where})", folder, pid)
    except syncredis.AuthenticationError:
        return PortOwner("a Redis that asks for a password")
    except syncredis.RedisError as exc:
        return PortOwner(f"something that does not answer as Redis ({exc})")
    finally:
        client.close()


class LocalCluster:
    """A Redis Cluster of ``masters`` primaries, each with ``replicas`` replicas, on loopback.

    For failover tests: ``kill`` a master (SIGKILL, as its host dying), ``wait_promoted`` for
    the cluster to promote its replica, ``revive`` the killed node (it rejoins as a replica of
    the promoted one). ``node_timeout_ms`` is ``cluster-node-timeout``: how long a silent
    master goes before its replicas may take over (Redis's default is 15 s)."""

    def __init__(
        self,
        folder: Path,
        masters: int = 3,
        *,
        replicas: int = 0,
        node_timeout_ms: int = 15000,
    ) -> None:
        self.folder = Path(folder)
        self.replicas = replicas
        options = {"cluster-node-timeout": node_timeout_ms}
        if replicas:
            # a replica serves no reads here (jobtier reads its masters); one that lost its
            # master for long still takes over, as a production cluster's would
            options |= {"cluster-replica-validity-factor": 0}
        self.nodes = [
            LocalRedis(self.folder / f"node{i}", cluster=True, options=options)
            for i in range(masters * (1 + replicas))
        ]
        self._killed_slot: dict[int, int | None] = {}

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
        try:
            subprocess.run(
                [
                    cli,
                    "--cluster",
                    "create",
                    *addrs,
                    "--cluster-replicas",
                    str(self.replicas),
                    "--cluster-yes",
                ],
                check=True,
                stdout=subprocess.DEVNULL,
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
                return _cluster_roles(node.port)
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
                with _connect(node.port) as client:
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
        with _connect(node.port) as client:
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
        deadline = time.monotonic() + timeout
        while True:
            try:
                node = self.master_of_slot(slot)
                if node is not killed and all(_cluster_ok(n.port) for n in self.running()):
                    return node
            except (RuntimeError, syncredis.RedisError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"no replica of the killed master {killed.port} took over within {timeout:g}s"
                )
            time.sleep(0.05)

    def revive(self, node: LocalRedis, timeout: float = 30.0) -> None:
        """Start a killed node again on its port and data: it rejoins as a replica of the
        master that took its slots; return once it replicates with its link up."""
        node.start()
        deadline = time.monotonic() + timeout
        while True:
            try:
                with _connect(node.port, decode_responses=True) as client:
                    info = client.info("replication")
                if info.get("role") == "slave" and info.get("master_link_status") == "up":
                    break
            except syncredis.RedisError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"node {node.port} did not rejoin as a replica in {timeout:g}s")
            time.sleep(0.05)
        self.wait_ok(timeout)

    def wait_replicated(self, timeout: float = 30.0) -> None:
        """Return once every master has its replicas attached with their links up."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                if all(len(_replicas_online(m.port)) >= self.replicas for m in self.masters()):
                    return
            except (RuntimeError, syncredis.RedisError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the local cluster's replicas did not attach in {timeout:g}s")
            time.sleep(0.05)

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Return once every running node reports ``cluster_state:ok``: each turns ok on its
        own, some time after it started, and answers keyed commands with CLUSTERDOWN until
        then (which a client pipeline does not retry)."""
        waiting = self.running()
        deadline = time.monotonic() + timeout
        while True:
            waiting = [node for node in waiting if not _cluster_ok(node.port)]
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
        for node in self.nodes:
            node.stop()


def _cluster_roles(port: int) -> dict[int, tuple[str, int | None]]:
    """CLUSTER NODES of the node on ``port``, as port -> (role, master's port)."""
    with _connect(port, decode_responses=True) as client:
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


def _replicas_online(port: int) -> list[int]:
    """The ports of the replicas attached to the master on ``port`` with their links up."""
    with _connect(port, decode_responses=True) as client:
        info = client.info("replication")
    ports = []
    for key, value in info.items():
        if key.startswith("slave") and isinstance(value, dict) and value.get("state") == "online":
            ports.append(int(value["port"]))
    return ports


class LocalSentinels:
    """One master, ``replicas`` replicas and ``count`` Sentinels watching them, on loopback:
    the single-master deployment that fails over (JOBTIER_REDIS_SENTINELS).

    ``down_after_ms`` is how long the sentinels wait before they call a silent master down;
    ``failover_timeout_ms`` bounds a failover attempt (a second one waits twice that)."""

    def __init__(
        self,
        folder: Path,
        *,
        name: str = "jobtier",
        replicas: int = 1,
        count: int = 3,
        down_after_ms: int = 2000,
        failover_timeout_ms: int = 4000,
    ) -> None:
        self.folder = Path(folder)
        self.name = name
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms
        first = LocalRedis(self.folder / "redis0")
        self.nodes = [first] + [
            LocalRedis(
                self.folder / f"redis{i + 1}",
                options={"replicaof": ("127.0.0.1", first.port)},
            )
            for i in range(replicas)
        ]
        self.sentinel_ports = [free_port() for _ in range(count)]
        self.sentinels: list[subprocess.Popen[bytes]] = []

    @property
    def addresses(self) -> str:
        """JOBTIER_REDIS_SENTINELS for this set."""
        return ",".join(f"127.0.0.1:{port}" for port in self.sentinel_ports)

    @property
    def url(self) -> str:
        """JOBTIER_REDIS_URL beside it: the database (the host is the sentinels' answer)."""
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
        conf = folder / "sentinel.conf"  # a sentinel rewrites its file: it must be its own
        master = self.nodes[0].port
        conf.write_text(
            f"port {port}\nbind 127.0.0.1\ndir {folder}\nprotected-mode no\n"
            f"logfile {folder / 'sentinel.log'}\n"
            f"sentinel monitor {self.name} 127.0.0.1 {master} 2\n"
            f"sentinel down-after-milliseconds {self.name} {self.down_after_ms}\n"
            f"sentinel failover-timeout {self.name} {self.failover_timeout_ms}\n"
            f"sentinel parallel-syncs {self.name} 1\n"
        )
        args = [redis_server_binary(), str(conf), "--sentinel"]
        return subprocess.Popen(
            tied(args, signal.SIGTERM), stdin=subprocess.DEVNULL, start_new_session=True
        )

    def master(self) -> LocalRedis:
        """The node the sentinels name master now."""
        port = self._sentinel_master_port()
        return next(n for n in self.nodes if n.port == port)

    def _sentinel_master_port(self) -> int:
        for port in self.sentinel_ports:
            try:
                with _connect(port, 2.0, decode_responses=True) as client:
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
        deadline = time.monotonic() + timeout
        while True:
            try:
                port = self._sentinel_master_port()
                if port != killed.port:
                    with _connect(port, decode_responses=True) as client:
                        if client.info("replication").get("role") == "master":
                            return next(n for n in self.nodes if n.port == port)
            except (RuntimeError, syncredis.RedisError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the sentinels promoted no replica within {timeout:g}s")
            time.sleep(0.05)

    def revive(self, node: LocalRedis, timeout: float = 30.0) -> None:
        """Start a killed node again, as a replica of the master the sentinels promoted (as
        an operator brings a failed host back); return once it replicates with its link up."""
        node.options["replicaof"] = ("127.0.0.1", self.master().port)
        node.start()
        deadline = time.monotonic() + timeout
        while True:
            try:
                with _connect(node.port, decode_responses=True) as client:
                    info = client.info("replication")
                if info.get("role") == "slave" and info.get("master_link_status") == "up":
                    return
            except syncredis.RedisError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"node {node.port} did not rejoin as a replica in {timeout:g}s")
            time.sleep(0.05)

    def wait_replicated(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                master = self.nodes[0] if not self.sentinels else self.master()
                if len(_replicas_online(master.port)) >= len(self.nodes) - 1:
                    return
            except (RuntimeError, syncredis.RedisError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the replicas did not attach within {timeout:g}s")
            time.sleep(0.05)

    def wait_sentinels(self, timeout: float = 30.0) -> None:
        """Return once every sentinel knows the master, its replicas and the other sentinels
        (only then can they agree on a failover)."""
        deadline = time.monotonic() + timeout
        want_sentinels, want_replicas = len(self.sentinel_ports) - 1, len(self.nodes) - 1
        while True:
            ready = 0
            for port in self.sentinel_ports:
                try:
                    with _connect(port, 2.0, decode_responses=True) as client:
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


def _cluster_ok(port: int) -> bool:
    client = _connect(port)
    try:
        info = client.execute_command("CLUSTER", "INFO")  # type: ignore[no-untyped-call]
    except syncredis.RedisError:
        return False
    finally:
        client.close()
    return b"cluster_state:ok" in info


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
