"""A local Postgres for `jobtier run`, the tests and the benchmarks; never for production.

It runs from the installed server binaries (the highest version under
``/usr/lib/postgresql``), its data in a folder of the caller's choosing, listening on loopback
only, as a child process tied to ours (``jobtier.dev.procs``). Local connections are trusted
(no password): acceptable for a loopback-only development server, never elsewhere.

Postgres refuses to run as root: as root we run it as an unprivileged user (``postgres``,
else ``jobtier-pg``, else ``nobody``) through ``setpriv`` and hand the folder to that user.
When that user cannot reach the folder (a clone under ``/root``), the data goes to
``/var/tmp/jobtier-pg-<hash of the folder's path>`` instead (the same place on every run), a
note in the folder says where, and the start is logged as ``local_postgres_relocated``.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import pwd
import re
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from jobtier.dev.local_redis import PortOwner, free_port
from jobtier.dev.procs import LocalServiceError, as_user, leftover, stop_child, tied

log = logging.getLogger("jobtier.dev")

PG_ROOT = Path("/usr/lib/postgresql")
SUPERUSER = "postgres"
SERVICE_USERS = ("postgres", "jobtier-pg", "nobody")
RELOCATED_NOTE = "DATA-IS-ELSEWHERE.txt"
_IDENT = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")  # role and database names go into SQL text
_PLAIN_VALUE = re.compile(r"^[A-Za-z0-9_.:+-]{1,64}$")  # a setting's value, quoted in jobtier.conf
_STOP_SIGNALS = {"smart": signal.SIGTERM, "fast": signal.SIGINT, "immediate": signal.SIGQUIT}


def pg_bin_dir(root: Path = PG_ROOT) -> Path:
    """The ``bin`` folder of the highest installed Postgres version."""
    found = []
    if root.is_dir():
        for entry in root.iterdir():
            bindir = entry / "bin"
            if (bindir / "postgres").exists() and (bindir / "initdb").exists():
                try:
                    found.append((tuple(int(p) for p in entry.name.split(".")), bindir))
                except ValueError:
                    continue
    if not found:
        raise RuntimeError(
            f"no Postgres server under {root}: `apt-get install postgresql` (make run/test do it)"
        )
    return max(found)[1]


def _service_user() -> str:
    """The unprivileged user to run Postgres as when we are root."""
    for name in SERVICE_USERS:
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(name).pw_name
    raise LocalServiceError(
        "Postgres cannot run as root and none of the users "
        f"{', '.join(SERVICE_USERS)} exists to run it as: create one (useradd --system postgres)"
    )


def relocated_folder(folder: Path) -> Path:
    """Where the data of ``folder`` goes when the service user cannot reach it."""
    digest = hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:16]
    base = Path("/var/tmp") if Path("/var/tmp").is_dir() else Path(tempfile.gettempdir())
    return base / f"jobtier-pg-{digest}"


def _quiet(command: list[str], **options: Any) -> subprocess.CompletedProcess[str]:
    """Run ``command`` without input, its output captured."""
    return subprocess.run(
        command, stdin=subprocess.DEVNULL, capture_output=True, text=True, **options
    )


class LocalPostgres:
    """One Postgres server: ``start()`` initialises the folder on first use, then runs it.

    ``durable=False`` turns off fsync and synchronous commit: right for tests, wrong for
    benchmarks. ``collation`` is the database's LC_COLLATE, fixed when the folder is first
    initialised: ``C`` orders UTF-8 text as ``C.UTF-8`` does, but only ``C`` takes Postgres's
    fast path for comparisons, which the write-behind makes at every index entry.
    """

    def __init__(
        self,
        folder: Path,
        port: int | None = None,
        *,
        user: str = "jobtier",
        database: str = "jobtier",
        durable: bool = True,
        bin_dir: Path | None = None,
        collation: str = "C",
        settings: Mapping[str, str] | None = None,
    ) -> None:
        for name in (user, database):
            if not _IDENT.match(name):
                raise ValueError(f"not a plain SQL identifier: {name!r}")
        for name, value in (settings or {}).items():
            if not _IDENT.match(name) or not _PLAIN_VALUE.match(value):
                raise ValueError(f"not a plain Postgres setting: {name}={value!r}")
        self.requested = Path(folder).absolute()
        self.folder = self.requested  # moved by start() when run_as cannot reach it
        self.port = port or free_port()
        self.user = user
        self.database = database
        self.durable = durable
        self.collation = collation
        self.settings = dict(settings or {})  # more postgresql.conf lines: name = 'value'
        self.bin_dir = bin_dir or pg_bin_dir()
        self.run_as = _service_user() if os.geteuid() == 0 else None
        self.socket_dir = self._socket_dir()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def data(self) -> Path:
        return self.folder / "data"

    @property
    def logfile(self) -> Path:
        return self.folder / "postgres.log"

    @property
    def relocated(self) -> bool:
        return self.folder != self.requested

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    # --- addresses ------------------------------------------------------------------------
    @property
    def dsn(self) -> str:
        """DSN of the application role and database."""
        return self.dsn_for(self.database)

    def dsn_for(self, database: str, user: str | None = None) -> str:
        return f"postgresql://{user or self.user}@127.0.0.1:{self.port}/{database}"

    def _socket_dir(self) -> Path:
        # a unix socket path must fit in 107 bytes (sun_path); deep folders fall back to /tmp
        sock = self.folder / "sock"
        if len(str(sock / ".s.PGSQL.65535")) < 100:
            return sock
        return Path(tempfile.mkdtemp(prefix="jtpg-"))

    # --- running --------------------------------------------------------------------------
    def _run(self, name: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        result = _quiet(as_user([str(self.bin_dir / name), *args], self.run_as), cwd="/")
        if check and result.returncode != 0:
            raise RuntimeError(
                f"{name} {' '.join(args)} failed ({result.returncode}): "
                f"{(result.stderr or result.stdout).strip()[-2000:]}"
            )
        return result

    def _hand_over(self, path: Path) -> None:
        assert self.run_as is not None
        entry = pwd.getpwnam(self.run_as)
        shutil.chown(path, entry.pw_uid, entry.pw_gid)
        for sub in path.rglob("*"):
            os.chown(sub, entry.pw_uid, entry.pw_gid, follow_symlinks=False)

    def _reachable(self, path: Path) -> bool:
        """Can ``run_as`` write in ``path`` (and search every folder above it)?"""
        probe = as_user(["test", "-w", str(path), "-a", "-x", str(path)], self.run_as)
        return _quiet(probe, cwd="/").returncode == 0

    def prepare(self) -> None:
        """Make the folder ready for ``run_as`` (moving it if need be); idempotent."""
        self.folder.mkdir(parents=True, exist_ok=True)
        if self.run_as:
            self._hand_over(self.folder)
            if not self.relocated and not self._reachable(self.folder):
                self._relocate()
        if not self.relocated:
            (self.folder / RELOCATED_NOTE).unlink(missing_ok=True)
        self.socket_dir.mkdir(parents=True, exist_ok=True)
        if self.run_as:
            self._hand_over(self.socket_dir)

    def _relocate(self) -> None:
        """Move to a folder ``run_as`` can reach (see the module docstring)."""
        assert self.run_as is not None
        target = relocated_folder(self.requested)
        entry = pwd.getpwnam(self.run_as)
        with contextlib.suppress(FileExistsError):
            target.mkdir(mode=0o700)
        # /var/tmp is writable by everyone: use only a real folder that we or run_as own
        st = target.lstat()
        if not stat.S_ISDIR(st.st_mode) or st.st_uid not in (0, entry.pw_uid):
            raise LocalServiceError(
                f"{target} exists but is not a folder owned by root or {self.run_as}: remove it "
                "(it is where Postgres data goes when its own folder is unreachable)"
            )
        self.folder = target
        self.socket_dir = self._socket_dir()
        self._hand_over(target)
        (self.requested / RELOCATED_NOTE).write_text(
            f"The Postgres data of this folder is in {target}:\n{self.requested} is not "
            f"reachable by user {self.run_as}, which Postgres runs as (it refuses to run as "
            "root).\nDelete that folder too when you delete this one.\n"
        )
        log.info(
            "event=local_postgres_relocated from=%s to=%s user=%s: the folder is not reachable "
            "by the user Postgres runs as; its data lives there instead",
            self.requested,
            target,
            self.run_as,
        )

    def _initdb(self) -> None:
        args = ["-D", str(self.data), "-U", SUPERUSER, "--auth=trust", "--encoding=UTF8"]
        args += ["--locale=C.UTF-8", f"--lc-collate={self.collation}", "--no-instructions"]
        if not self.durable:
            args.append("--no-sync")
        self._run("initdb", *args)
        with (self.data / "postgresql.conf").open("a") as conf:
            conf.write("\ninclude_if_exists = 'jobtier.conf'\n")

    def _write_conf(self) -> None:
        lines = [
            f"port = {self.port}",
            "listen_addresses = '127.0.0.1'",
            f"unix_socket_directories = '{self.socket_dir}'",
            "max_connections = 200",
            "shared_buffers = '128MB'",
            "log_min_messages = warning",
        ]
        if not self.durable:
            lines += ["fsync = off", "synchronous_commit = off", "full_page_writes = off"]
        lines += [f"{name} = '{value}'" for name, value in self.settings.items()]
        conf = self.data / "jobtier.conf"
        conf.write_text("\n".join(lines) + "\n")
        if self.run_as:
            self._hand_over(conf)

    def start(self) -> LocalPostgres:
        """Initialise (first time), start, and make sure the role and database exist."""
        if self.proc is not None and self.proc.poll() is not None:
            # ours died: reap it now, or its zombie's pid would pass the next lock-file check
            self.proc = None
        self.prepare()
        if not (self.data / "PG_VERSION").exists():
            self._initdb()
        self._write_conf()
        # the postmaster is our own child (pg_ctl would detach it), so that the kernel can stop
        # it when we die; SIGINT is its fast shutdown
        postgres = [str(self.bin_dir / "postgres"), "-D", str(self.data)]
        with self.logfile.open("ab") as logfile:
            self.proc = subprocess.Popen(
                tied(postgres, signal.SIGINT, self.run_as),
                stdin=subprocess.DEVNULL,
                stdout=logfile,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd="/",
            )
        try:
            self._wait_ready()
            self._ensure_database()
        except BaseException:
            self.stop("immediate")
            raise
        return self

    def _wait_ready(self, timeout: float = 120.0) -> None:
        """Until the postmaster reports ``ready`` in its pidfile (what ``pg_ctl -w`` reads)."""
        assert self.proc is not None
        pidfile = self.data / "postmaster.pid"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.logfile.read_text(errors="replace")[-2000:]
                raise RuntimeError(
                    f"postgres exited with {self.proc.returncode} ({self.logfile}):\n{tail}"
                )
            try:
                lines = pidfile.read_text().splitlines()
            except OSError:
                lines = []
            ours = len(lines) >= 8 and lines[0].strip() == str(self.proc.pid)
            if ours and lines[7].strip() == "ready":
                return
            time.sleep(0.05)
        raise TimeoutError(f"postgres on port {self.port} not ready after {timeout:g}s")

    def stop(self, mode: str = "fast") -> None:
        """Stop the server (``fast``: disconnect clients, clean shutdown; ``immediate``: crash)."""
        if self.proc is not None:
            stop_child(self.proc, _STOP_SIGNALS[mode])
            self.proc = None
        elif self.running:  # not started by this object
            self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "-t", "60", "stop")

    def restart(self) -> None:
        self.stop()
        self.start()

    @property
    def running(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        if not (self.data / "PG_VERSION").exists():
            return False
        return self._run("pg_ctl", "-D", str(self.data), "status", check=False).returncode == 0

    def leftover_pid(self) -> int | None:
        """The pid of a postmaster of this folder that we did not start (an earlier run's)."""
        return leftover(self.data / "postmaster.pid", "postgres", self.data, self.pid)

    def describe_port(self) -> PortOwner:
        """Ask whatever listens on our port who it is: a Postgres, with which data folder."""
        command = self._psql("postgres", "-w", "-c", "SHOW data_directory")
        result = _quiet(command, env={**os.environ, "PGCONNECT_TIMEOUT": "3"})
        if result.returncode == 0 and result.stdout.strip():
            folder = Path(result.stdout.strip())
            return PortOwner(f"a Postgres with data folder {folder}", folder)
        error = (result.stderr.strip().splitlines() or ["no answer"])[-1]
        return PortOwner(f"something we cannot use as Postgres superuser ({error})")

    def psql(self, sql: str, database: str = "postgres") -> str:
        """Run SQL as the superuser; returns the unaligned output."""
        result = _quiet(self._psql(database, "-q", "-v", "ON_ERROR_STOP=1", "-c", sql))
        if result.returncode != 0:
            raise RuntimeError(f"psql failed: {result.stderr.strip()}")
        return result.stdout

    def _psql(self, database: str, *args: str) -> list[str]:
        server = f"-h 127.0.0.1 -p {self.port} -U {SUPERUSER}".split()
        return [str(self.bin_dir / "psql"), "-X", "-tA", *server, "-d", database, *args]

    def _ensure_database(self) -> None:
        user, db = self.user, self.database
        if not self.psql(f"SELECT 1 FROM pg_roles WHERE rolname = '{user}'").strip():
            self.psql(f'CREATE ROLE "{user}" LOGIN CREATEDB')
        if not self.psql(f"SELECT 1 FROM pg_database WHERE datname = '{db}'").strip():
            self.psql(f'CREATE DATABASE "{db}" OWNER "{user}"')

    def destroy(self) -> None:
        """Stop and delete the folder (tests and benchmarks clean up after themselves)."""
        self.stop("immediate")
        for path in {self.folder, self.requested}:
            shutil.rmtree(path, ignore_errors=True)
        if not self.socket_dir.is_relative_to(self.folder):
            shutil.rmtree(self.socket_dir, ignore_errors=True)
