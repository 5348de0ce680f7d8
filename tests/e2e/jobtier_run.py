"""`jobtier run` as a subprocess for the tests: started, waited for, signalled, inspected.

Its log goes to a file; the pids of the servers it started come from its own log lines
(``local_redis_started … pid=``, ``local_postgres_started … pid=``), and Postgres's worker
processes from /proc (children of the postmaster), so that "nothing outlives it" is checked by
pid, not by port.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from jobtier.dev.local_redis import free_port
from jobtier.dev.procs import pid_alive

HANG_GUARD = 120.0  # s: only stops a broken test from hanging (a first start runs initdb)


def children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2 :].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def wait_until(predicate: Callable[[], bool], what: str, timeout: float = HANG_GUARD) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"gave up waiting: {what}"
        time.sleep(0.05)


def assert_gone(pids: list[int]) -> None:
    """Every one of ``pids`` ends (waiting only as a hang guard)."""
    wait_until(lambda: not [p for p in pids if pid_alive(p)], f"processes {pids} still alive")


class JobtierRun:
    """One `jobtier run` on ``data`` with free ports (or the ones given)."""

    def __init__(
        self,
        data: Path,
        log: Path,
        *args: str,
        redis_port: int | None = None,
        pg_port: int | None = None,
        api_port: int | None = None,
    ) -> None:
        self.data = data
        self.redis_port = redis_port or free_port()
        self.pg_port = pg_port or free_port()
        self.api_port = api_port or free_port()
        self.log = log
        env = {k: v for k, v in os.environ.items() if not k.startswith("JOBTIER_")}
        env["JOBTIER_API_PORT"] = str(self.api_port)
        command = [
            sys.executable, "-m", "jobtier.cli.main", "run", "--data-dir", str(data),
            "--redis-port", str(self.redis_port), "--pg-port", str(self.pg_port), *args,
        ]  # fmt: skip
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=out,
            )  # fmt: skip
        self.base = f"http://127.0.0.1:{self.api_port}"

    def text(self) -> str:
        return self.log.read_text()

    def events(self) -> list[str]:
        return re.findall(r"event=(\w+)", self.text())

    def field(self, event: str, key: str) -> str:
        line = next(x for x in self.text().splitlines() if f"event={event} " in x)
        match = re.search(rf"\b{key}=(\S+)", line)
        assert match, line
        return match.group(1)

    def wait_ready(self) -> None:
        def ready() -> bool:
            assert self.proc.poll() is None, self.text()[-3000:]
            try:
                return httpx.get(f"{self.base}/readyz").status_code == 200
            except httpx.TransportError:
                return False

        wait_until(ready, "jobtier run ready")

    def wait_logged(self, event: str) -> None:
        wait_until(lambda: event in self.events(), f"{event} logged")

    def server_pids(self) -> list[int]:
        """Redis, the postmaster and the postmaster's children."""
        redis = int(self.field("local_redis_started", "pid"))
        postmaster = int(self.field("local_postgres_started", "pid"))
        return [redis, postmaster, *children(postmaster)]

    def keys(self) -> tuple[str, str]:
        """(the tenant's key, the admin key) the run made (dev-keys.json)."""
        keys = json.loads((self.data / "dev-keys.json").read_text())
        return str(keys["tenant_key"]), str(keys["admin_key"])

    def tenant_key(self) -> str:
        return self.keys()[0]

    def exit_code(self) -> int:
        try:
            return self.proc.wait(HANG_GUARD)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError("jobtier run did not exit: " + self.text()[-3000:]) from None

    def stop(self) -> None:
        """Test teardown: SIGTERM, and SIGKILL if it hangs (its servers die with it)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(HANG_GUARD)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def copy_pg_template(template: Path, data: Path) -> None:
    """An initialised Postgres folder for a run (initdb takes seconds; a copy does not)."""
    shutil.copytree(template, data / "pg", symlinks=True)
