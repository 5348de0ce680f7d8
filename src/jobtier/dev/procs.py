"""Process plumbing for the development servers: tying a server's life to ours, identifying
a process by its pid, and the lock that gives one `jobtier run` a data folder.

Servers die with us: if `jobtier run` is killed (SIGKILL, an OOM kill, a crash in C code) no
Python code runs, and its children would live on, holding their ports and data. Each server
is therefore started through ``setpriv --pdeathsig SIG`` (util-linux), which sets the kernel's
parent-death signal and execs the server in the same process: however we die, the kernel
sends it SIG (Redis: SIGTERM, its AOF flushed; Postgres: SIGINT, its fast shutdown). The same
``setpriv`` drops root for Postgres; a change of user clears the death signal, and
``setpriv`` applies the signal last.

Two limits: the kernel's "parent" is the *thread* that forked, so a server is tied only when
started from the main thread (`jobtier run` does; a test restarting one from a pool thread
leaves it untied and stops it itself); and a signal that kills us between fork and ``prctl``
is missed: the next `jobtier run` of that folder finds the server and restarts it
(``jobtier.dev.stack``).
"""

from __future__ import annotations

import fcntl
import os
import pwd
import shutil
import signal
import subprocess
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
    """Is ``pid`` a running process? A zombie (dead, not yet reaped) is not."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2 :][:1] not in ("Z", "X")


def process_cwd(pid: int) -> Path | None:
    """The working folder of ``pid``, or None when it is gone or not ours to look at."""
    try:
        return Path(os.readlink(f"/proc/{pid}/cwd"))
    except OSError:
        return None


def process_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def leftover(pidfile: Path, name: str, folder: Path, ours: int | None) -> int | None:
    """The pid in ``pidfile`` when it is a live ``name`` process, not ``ours``, working in
    ``folder`` (Redis and Postgres work in their data folder): an earlier run's server."""
    pid = read_pid(pidfile)
    if pid is None or pid == ours or not pid_alive(pid):
        return None
    if process_name(pid).startswith(name) and process_cwd(pid) == folder.resolve():
        return pid
    return None


def read_pid(path: Path) -> int | None:
    """The pid on the first line of a pidfile, if any."""
    try:
        first = path.read_text().split("\n", 1)[0].strip()
        return int(first) if first else None
    except (OSError, ValueError):
        return None


def stop_child(proc: subprocess.Popen[bytes], sig: int, timeout: float = 60.0) -> None:
    """Signal a child and wait for it to exit; SIGKILL after ``timeout``."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


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

    The kernel drops it however the process ends, so a held lock always means a live
    `jobtier run`, and a server of this folder found while we hold it is a leftover (servers
    do not inherit the descriptor).
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
