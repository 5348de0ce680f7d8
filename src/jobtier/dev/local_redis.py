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
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis as syncredis

from jobtier.dev.procs import leftover, process_cwd, stop_child, tied

log = logging.getLogger("jobtier.dev")

LOCAL_CONF = "redis.local.conf"  # optional, in the data folder: the user's own settings
SECRETS_CONF = "redis.secrets.conf"  # written at each start: the passwords among its options
# and the ACL users given at start (``user``: their passwords among its words)
SECRET_OPTIONS = ("requirepass", "masterauth", "user")
CLUSTER_BUS_OFFSET = 10000  # a cluster node also listens on its port + this (the bus)


class PortTaken(RuntimeError):
    """A local server exited at start because one of its ports was taken (something bound it
    after the port was chosen free)."""


# the ports free_port handed out lately: the kernel may offer a port again as soon as it is
# released, before whoever asked for it has bound it (a run's Redis and Postgres were once
# given the same one)
_GIVEN: deque[int] = deque(maxlen=1024)


def free_port(below: int = 65536, *, also: int = 0) -> int:
    """A free loopback port under ``below``, not one of the last ones it handed out; with
    ``also``, port + ``also`` is free too (a cluster node's bus port: taken, the node exits
    at start)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port < below and port not in _GIVEN and (not also or _bindable(port + also)):
            _GIVEN.append(port)
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


def conf_quoted(value: Any) -> str:
    """``value`` as one word of a redis.conf line: double-quoted, with a backslash before a
    quote or a backslash and anything else not printable ASCII (a newline) as \\xHH."""
    out = []
    for ch in str(value):
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch.isascii() and ch.isprintable():
            out.append(ch)
        else:
            out.extend(f"\\x{b:02x}" for b in ch.encode())
    return '"' + "".join(out) + '"'


def write_private(path: Path, text: str) -> Path:
    """Write ``text`` to ``path``, readable by its owner alone from its first byte (a server's
    passwords)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # (a file there before keeps its mode otherwise)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path


def connect_to(port: int, timeout: float = 5.0, **options: Any) -> syncredis.Redis:
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
        free_ports: bool = False,
    ) -> None:
        self.folder = Path(folder).absolute()
        self.cluster = cluster
        self.port = port or self._free_port()
        self.options = dict(options or {})  # more server options (a replica's replicaof, ...)
        # its ports (``port``, ``tls-port``) were chosen free, and nothing has been told them
        # before its first start: one taken meanwhile is chosen again
        self.free_ports = free_ports
        self.started = False
        self.proc: subprocess.Popen[bytes] | None = None

    def _free_port(self) -> int:
        if self.cluster:  # its cluster bus too (on its port + 10000, or its TLS port's)
            return free_port(65536 - CLUSTER_BUS_OFFSET, also=CLUSTER_BUS_OFFSET)
        return free_port()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def password(self) -> str | None:
        """The default user's password (``requirepass`` among its options), which this
        class's own connections give; None when it has none (`jobtier run`'s)."""
        value = self.options.get("requirepass")
        return str(value) if value else None

    def client(self, timeout: float = 5.0, **options: Any) -> syncredis.Redis:
        """A client of it as the default user, with its password when it has one."""
        return connect_to(self.port, timeout, password=self.password, **options)

    @property
    def pidfile(self) -> Path:
        return self.folder / "redis.pid"

    def _secrets_file(self, secret: dict[str, Any]) -> Path:
        """``secret`` options written to a file of the data folder (a tuple: its words)."""
        lines = []
        for name, value in secret.items():
            values = value if isinstance(value, tuple) else (value,)
            lines.append(" ".join([name, *map(conf_quoted, values)]) + "\n")
        return write_private(self.folder / SECRETS_CONF, "".join(lines))

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    def start(self, *, loaded: bool = True) -> LocalRedis:
        """Start it and return once it answers commands (after loading its AOF, however long
        that takes: progress is logged as ``local_redis_loading``); ``loaded=False``: once
        it listens (for tests of what clients do while it loads).

        With ``free_ports``, a first start that finds a port taken chooses its ports again
        (twice at most); otherwise, and after that, it raises ``PortTaken``."""
        for tries_left in (2, 1, 0):
            try:
                self._start(loaded)
            except PortTaken as exc:
                if not self.free_ports or self.started or not tries_left:
                    raise
                log.info("event=local_redis_port_taken %s: choosing its ports again", exc)
                self.port = self._free_port()
                if "tls-port" in self.options:
                    self.options["tls-port"] = self._free_port()
                continue
            self.started = True
            break
        return self

    def _start(self, loaded: bool) -> None:
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
        # passwords go in a file only its owner reads, not on the command line, where every
        # user of the machine sees them (ps, /proc/<pid>/cmdline)
        secret = {name: options.pop(name) for name in SECRET_OPTIONS if name in options}
        if secret:
            args += ["--include", str(self._secrets_file(secret))]
        for name, value in options.items():
            values = value if isinstance(value, tuple) else (value,)  # replicaof: (host, port)
            args += [f"--{name}", *map(str, values)]
        logfile = Path(str(options["logfile"]))
        logged = logfile.stat().st_size if logfile.exists() else 0
        # its own session: Ctrl-C reaches `jobtier run`, which stops it after the parts
        self.proc = subprocess.Popen(
            tied(args, signal.SIGTERM), stdin=subprocess.DEVNULL, start_new_session=True
        )
        try:
            try:
                wait_port(self.port, proc=self.proc)
                if loaded:
                    self.wait_loaded()
            except Exception:
                # exited: why, from its log. A cluster node binds its bus a moment after its
                # port, so a taken bus port may show only once its port answered
                if self.proc.poll() is None:
                    raise
                raise self._exit_error(logfile, logged) from None
        except BaseException:
            self.stop()
            raise

    def _exit_error(self, logfile: Path, since: int) -> RuntimeError:
        """Why it exited at start, from what it logged this time (a taken port: PortTaken)."""
        try:
            with logfile.open("rb") as f:
                f.seek(since)
                lines = f.read().decode(errors="replace").splitlines()[-6:]
        except OSError:
            lines = []
        code = self.proc.returncode if self.proc is not None else None
        said = "; ".join(line.strip() for line in lines) or f"nothing in {logfile}"
        message = f"redis-server on port {self.port} exited with {code} at start: {said}"
        if any("Address already in use" in line for line in lines):
            return PortTaken(message)
        return RuntimeError(message)

    def wait_loaded(self, stalled: float = 30.0) -> None:
        """Return once the server answers commands. While it loads its data (it then answers
        only INFO and the like, with ``loading:1``) wait, logging the progress; give up only
        when it neither answers nor progresses for ``stalled`` seconds."""
        client = self.client()
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
    client = connect_to(port, 3.0, decode_responses=True)
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
