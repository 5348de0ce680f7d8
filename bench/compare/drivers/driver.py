"""What every Python peer driver shares: its command line, the lines it reports, a countdown.

A driver runs in its peer's own virtualenv (bench/compare/.venv/<peer>/), never in jobtier's,
and imports nothing of jobtier. ``bench/compare.py`` runs it in one of two roles:

* ``enqueue``: enqueue ``--jobs`` no-op jobs, then report
  ``compare: {"t0": s, "t1": s, "cpu": s}`` (epoch seconds around the enqueues; CPU seconds of
  the process over them) and exit;
* ``worker``: start one worker, report ``compare: {"ready": true}``, count the jobs the peer
  reports finished, report ``compare: {"done": s, "completed": n, "failed": n}`` at the last
  one, and run until stopped (SIGTERM).

Only lines that start with ``compare: `` are read by the harness; anything else the peer prints
is ignored.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from typing import Any


def parse(description: str, **extra: Any) -> argparse.Namespace:
    """The driver's arguments; ``extra`` adds peer-specific options (name=default)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("role", choices=("enqueue", "worker"))
    p.add_argument("--url", required=True, help="redis://127.0.0.1:PORT/0")
    p.add_argument("--jobs", type=int, default=20_000)
    p.add_argument("--concurrency", type=int, default=50)
    p.add_argument("--batch", type=int, default=500, help="jobs per bulk call, where bulk exists")
    p.add_argument("--in-flight", type=int, default=50, help="concurrent enqueues (async clients)")
    for name, default in extra.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default)
    return p.parse_args()


def emit(**fields: Any) -> None:
    print("compare: " + json.dumps(fields), flush=True)


class Enqueueing:
    """``with Enqueueing(): ...`` around the enqueues reports t0, t1 and CPU when it ends."""

    def __enter__(self) -> Enqueueing:
        self.cpu0 = time.process_time()
        self.t0 = time.time()
        return self

    def __exit__(self, *exc: object) -> None:
        t1 = time.time()
        if exc[0] is None:
            emit(t0=self.t0, t1=t1, cpu=time.process_time() - self.cpu0)


class Countdown:
    """Counts finished jobs (from any thread); reports ``done`` when all ``jobs`` are."""

    def __init__(self, jobs: int) -> None:
        self.jobs = jobs
        self.completed = 0
        self.failed = 0
        self._lock = threading.Lock()

    def finished(self, ok: bool = True) -> None:
        with self._lock:
            if ok:
                self.completed += 1
            else:
                self.failed += 1
            if self.completed + self.failed == self.jobs:
                emit(done=time.time(), completed=self.completed, failed=self.failed)
