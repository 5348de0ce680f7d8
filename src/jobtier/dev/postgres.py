"""A local Postgres for `jobtier run`, the tests and the benchmarks.

It runs from the installed server binaries (``/usr/lib/postgresql/<version>/bin``, the highest
version present), with its data in a folder of the caller's choosing, listening on loopback
only, its unix socket inside that folder. Nothing here is used in production deployments.

Postgres refuses to run as root. When we are root, the server runs as the ``postgres`` user
(Debian's server package creates it) or, failing that, as a ``jobtier-pg`` system user created
on first use, through ``runuser``; the folder is handed to that user. Local connections are
trusted (no password): acceptable for a loopback-only development server, never elsewhere.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from jobtier.dev.redis import free_port

PG_ROOT = Path("/usr/lib/postgresql")
SUPERUSER = "postgres"
SERVICE_USERS = ("postgres", "jobtier-pg")
_IDENT = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")  # role and database names go into SQL text


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
    """The unprivileged user to run Postgres as when we are root (created if need be)."""
    for name in SERVICE_USERS:
        try:
            pwd.getpwnam(name)
            return name
        except KeyError:
            continue
    subprocess.run(
        ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", "jobtier-pg"],
        check=True,
    )
    return "jobtier-pg"


class LocalPostgres:
    """One Postgres server: ``start()`` initialises the folder on first use, then runs it.

    ``durable=False`` turns off fsync and synchronous commit: right for tests (fast, and a
    crash of the test machine loses nothing of value), wrong for benchmarks that claim numbers.
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
    ) -> None:
        for name in (user, database):
            if not _IDENT.match(name):
                raise ValueError(f"not a plain SQL identifier: {name!r}")
        self.folder = Path(folder).absolute()
        self.port = port or free_port()
        self.user = user
        self.database = database
        self.durable = durable
        self.bin_dir = bin_dir or pg_bin_dir()
        self.data = self.folder / "data"
        self.logfile = self.folder / "postgres.log"
        self.socket_dir = self._socket_dir()
        self.run_as = _service_user() if os.geteuid() == 0 else None

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
    def _tool(self, name: str, *args: str) -> list[str]:
        command = [str(self.bin_dir / name), *args]
        if self.run_as:
            return ["runuser", "-u", self.run_as, "--", *command]
        return command

    def _run(self, name: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            self._tool(name, *args),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            cwd="/",
        )
        if check and result.returncode != 0:
            raise RuntimeError(
                f"{name} {' '.join(args)} failed ({result.returncode}): "
                f"{(result.stderr or result.stdout).strip()[-2000:]}"
            )
        return result

    def _prepare_folder(self) -> None:
        for path in (self.folder, self.socket_dir):
            path.mkdir(parents=True, exist_ok=True)
        if self.run_as:
            entry = pwd.getpwnam(self.run_as)
            for path in (self.folder, self.socket_dir):
                shutil.chown(path, entry.pw_uid, entry.pw_gid)
                for sub in path.rglob("*"):
                    os.chown(sub, entry.pw_uid, entry.pw_gid, follow_symlinks=False)
            # every folder above must be searchable by that user (pytest's temp root is 0700)
            probe = subprocess.run(
                ["runuser", "-u", self.run_as, "--", "test", "-w", str(self.folder)]
            )
            if probe.returncode != 0:
                raise RuntimeError(
                    f"{self.folder} is not reachable by user {self.run_as}: Postgres cannot run "
                    "as root, so its folder must sit under directories others can enter"
                )

    def _initdb(self) -> None:
        args = [
            "-D", str(self.data), "-U", SUPERUSER, "--auth=trust", "--encoding=UTF8",
            "--locale=C.UTF-8", "--no-instructions",
        ]  # fmt: skip
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
        conf = self.data / "jobtier.conf"
        conf.write_text("\n".join(lines) + "\n")
        if self.run_as:
            entry = pwd.getpwnam(self.run_as)
            os.chown(conf, entry.pw_uid, entry.pw_gid)

    def start(self) -> LocalPostgres:
        """Initialise (first time), start, and make sure the role and database exist."""
        self._prepare_folder()
        if not (self.data / "PG_VERSION").exists():
            self._initdb()
        self._write_conf()
        self._run(
            "pg_ctl", "-D", str(self.data), "-l", str(self.logfile), "-w", "-t", "60", "start"
        )
        self._ensure_database()
        return self

    def stop(self, mode: str = "fast") -> None:
        """Stop the server (``fast``: disconnect clients, clean shutdown; ``immediate``: crash)."""
        if self.running:
            self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "-t", "60", "stop")

    def restart(self) -> None:
        self.stop()
        self.start()

    @property
    def running(self) -> bool:
        if not (self.data / "PG_VERSION").exists():
            return False
        return self._run("pg_ctl", "-D", str(self.data), "status", check=False).returncode == 0

    def psql(self, sql: str, database: str = "postgres") -> str:
        """Run SQL as the superuser; returns the unaligned output."""
        result = subprocess.run(
            [
                str(self.bin_dir / "psql"), "-X", "-q", "-v", "ON_ERROR_STOP=1", "-tA",
                "-h", "127.0.0.1", "-p", str(self.port), "-U", SUPERUSER, "-d", database,
                "-c", sql,
            ],
            stdin=subprocess.DEVNULL, capture_output=True, text=True,
        )  # fmt: skip
        if result.returncode != 0:
            raise RuntimeError(f"psql failed: {result.stderr.strip()}")
        return result.stdout

    def _ensure_database(self) -> None:
        user, db = self.user, self.database
        if not self.psql(f"SELECT 1 FROM pg_roles WHERE rolname = '{user}'").strip():
            self.psql(f'CREATE ROLE "{user}" LOGIN CREATEDB')
        if not self.psql(f"SELECT 1 FROM pg_database WHERE datname = '{db}'").strip():
            self.psql(f'CREATE DATABASE "{db}" OWNER "{user}"')

    def destroy(self) -> None:
        """Stop and delete the folder (tests and benchmarks clean up after themselves)."""
        self.stop("immediate")
        shutil.rmtree(self.folder, ignore_errors=True)
        if not self.socket_dir.is_relative_to(self.folder):
            shutil.rmtree(self.socket_dir, ignore_errors=True)
