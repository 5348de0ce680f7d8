"""Process plumbing for the development servers: tying a server's life to ours, identifying
a process by its pid, and the lock that gives one `jobtier run` a data folder.

Why servers die with us: `jobtier run` starts Redis and Postgres as child processes; if it is
killed (SIGKILL, an OOM kill, a crash in C code) no Python code runs, and children would
live on, holding their ports and data. Each server is therefore started through ``setpriv
--pdeathsig SIG`` (util-linux, on every Debian system), which sets the kernel's
parent-death signal (``PR_SET_PDEATHSIG``) and then execs the server in the same process:
when we die, however we die, the kernel sends the server SIG (Redis: SIGTERM, a clean
shutdown with its AOF flushed; Postgres: SIGINT, its fast shutdown). The same ``setpriv``
drops root for Postgres (``--reuid``), before the death signal is set: a change of user
clears it, so the order matters and ``setpriv`` applies it last.

Two limits, both handled where they matter:

- the kernel's "parent" is the *thread* that forked, not the process: a server started from
  a pool thread would get its signal when that thread ends. A server is tied only when it is
  started from the main thread (`jobtier run` starts its servers there); from other threads
  (a test restarting a server through ``asyncio.to_thread``) it is left untied, and stopped
  by whoever started it;
- a signal that kills us in the few milliseconds between fork and ``prctl`` is missed; the
  next `jobtier run` of the same data folder finds that server and restarts it (see
  ``jobtier.dev.stack``).
"""

from __future__ import annotations

import fcntl
import os
import pwd
import shutil
import signal
import threading
import time
from pathlib import Path


class LocalServiceError(RuntimeError):
    """A development server cannot be started as asked; the message says what to do."""


def _setpriv() -> str:
    path = shutil.which("setpriv")
    if not path:
        raise LocalServiceError(
            "setpriv is not installed (Debian package util-linux): jobtier's local servers "
            "use it to stop with the process that started them"
        )
    return path


def tied(command: list[str], death_signal: int, run_as: str | None = None) -> list[str]:
    """``command`` wrapped to run as ``run_as`` (when given) and to receive ``death_signal``
    when the calling thread's process dies (main thread only: see the module docstring)."""
    prefix: list[str] = []
    if run_as is not None:
        prefix += as_user_args(run_as)
    if threading.current_thread() is threading.main_thread():
        prefix.append(f"--pdeathsig={signal.Signals(death_signal).name.removeprefix('SIG')}")
    if not prefix:
        return command
    return [_setpriv(), *prefix, "--", *command]


def as_user_args(user: str) -> list[str]:
    entry = pwd.getpwnam(user)
    return [f"--reuid={entry.pw_uid}", f"--regid={entry.pw_gid}", "--init-groups"]


def as_user(command: list[str], user: str | None) -> list[str]:
    """``command`` run as ``user`` (None: as we are)."""
    if user is None:
        return command
    return [_setpriv(), *as_user_args(user), "--", *command]


# --- identifying processes ------------------------------------------------------------------
def pid_alive(pid: int) -> bool:
    """Is ``pid`` a running process? A zombie (dead, not yet reaped: the parent of a killed
    run's servers may be slow to reap them) is not."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2 :][:1] not in ("Z", "X")


def process_cwd(pid: int) -> Path | None:
    """The working folder of ``pid`` (Redis and Postgres both chdir into their data folder),
    or None when it is gone or not ours to look at."""
    try:
        return Path(os.readlink(f"/proc/{pid}/cwd"))
    except OSError:
        return None


def process_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def read_pid(path: Path) -> int | None:
    """The pid on the first line of a pidfile, if any."""
    try:
        first = path.read_text().split("\n", 1)[0].strip()
        return int(first) if first else None
    except (OSError, ValueError):
        return None


def stop_pid(pid: int, sig: int, timeout: float = 60.0) -> bool:
    """Signal a process that is not our child and wait for it to go; SIGKILL after
    ``timeout``. True when it is gone."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return True
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return True
        time.sleep(0.05)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return True
    time.sleep(0.2)
    return not pid_alive(pid)


# --- one `jobtier run` per data folder ------------------------------------------------------
class FolderLock:
    """An exclusive ``flock`` on ``<folder>/run.lock`` for the life of this process.

    The kernel drops it when the process ends, however it ends, so a held lock always means a
    live `jobtier run`, and a server of this folder found while we hold it is a leftover. The
    servers do not inherit it (file descriptors are not passed to children).
    """

    def __init__(self, folder: Path) -> None:
        self.path = folder / "run.lock"
        self._fd: int | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = read_pid(self.path)
            os.close(fd)
            who = f" (pid {holder})" if holder else ""
            raise LocalServiceError(
                f"another `jobtier run`{who} is using {self.path.parent}: stop it first, or give "
                "this one its own --data-dir and ports (--redis-port, --pg-port, JOBTIER_API_PORT)"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the lock; the file stays (harmless)
            self._fd = None
