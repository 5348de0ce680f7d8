"""Tasks the process-pool tests run in child processes (tests/integration/test_process_pool.py).

A child imports this module by name, so each task is a top-level function here."""

from __future__ import annotations

import ctypes
import hashlib
import os
import time
from typing import Any

from jobtier.core.errors import Retry
from jobtier.worker.registry import TaskRegistry, task

_held: list[bytes] = []  # what ``leak`` keeps: the child's memory grows job by job


def _spin_until(ctx: Any, seconds: float) -> None:
    """Burn CPU (no sleeping: the test is about work that holds the GIL)."""
    end = time.monotonic() + seconds
    data = b"x" * 1024
    while time.monotonic() < end:
        data = hashlib.sha256(data).digest() * 32


@task(executor="process", retries=0)
def pid_of(ctx: Any, payload: Any) -> dict[str, int]:
    return {"pid": os.getpid()}


@task(executor="process", retries=0)
def leak(ctx: Any, payload: Any) -> dict[str, int]:
    _held.append(b"x" * (int(payload["mib"]) * 1024 * 1024))
    return {"pid": os.getpid()}


@task(executor="process", retries=2, backoff_base=0.05, jitter=0)
def killed_once(ctx: Any, payload: Any) -> dict[str, int]:
    """Shows its pid, then spins until the test kills it; the retry returns."""
    if ctx.attempt == 1:
        ctx.progress({"pid": os.getpid()})
        _spin_until(ctx, 60)
    return {"attempt": ctx.attempt, "pid": os.getpid()}


@task(executor="process", retries=1, backoff_base=0.05, jitter=0)
def aborts(ctx: Any, payload: Any) -> None:
    os.abort()  # SIGABRT, as a C extension's failed assertion would


@task(executor="process", retries=0)
def segfaults(ctx: Any, payload: Any) -> None:
    ctypes.string_at(0)  # reads address 0: SIGSEGV, as a broken C extension would


@task(executor="process", retries=0)
def spins(ctx: Any, payload: Any) -> None:
    """Never looks at ctx.cancel_requested: only ending its process stops it."""
    ctx.progress({"pid": os.getpid()})
    _spin_until(ctx, 60)


@task(executor="process", retries=0, timeout=1.0)
def spins_too_long(ctx: Any, payload: Any) -> None:
    ctx.progress({"pid": os.getpid()})
    _spin_until(ctx, 60)


@task(executor="process", retries=0)
def cooperative(ctx: Any, payload: Any) -> None:
    """Logs and reports progress from the child, and stops when asked."""
    ctx.log(f"started in {os.getpid()}")
    ctx.progress({"pid": os.getpid(), "attempt": ctx.attempt, "job": ctx.job_id})
    while not ctx.cancel_requested:
        _spin_until(ctx, 0.01)
    ctx.log("saw the cancel request")
    ctx.check_cancelled()


@task(executor="process", retries=0)
def steady(ctx: Any, payload: Any) -> dict[str, int]:
    """Busy for a while, in a child the test leaves alone."""
    ctx.progress({"pid": os.getpid()})
    _spin_until(ctx, float(payload["seconds"]))
    return {"pid": os.getpid()}


@task(executor="process", retries=0)
def raises(ctx: Any, payload: Any) -> None:
    raise ValueError(f"bad input {payload!r}")


@task(retries=0)
def plain(ctx: Any, payload: Any) -> dict[str, int]:
    """Names no executor: the worker's --executor decides."""
    return {"pid": os.getpid()}


@task(retries=0)
async def echo(ctx: Any, payload: Any) -> Any:
    return payload


registry = TaskRegistry(
    [
        pid_of,
        leak,
        killed_once,
        aborts,
        spins,
        spins_too_long,
        cooperative,
        steady,
        raises,
        plain,
        echo,
    ]
)


@task(executor="process", retries=0)
def reads_previous(ctx: Any, payload: Any) -> dict[str, Any]:
    return {"previous": ctx.previous, "ids": list(ctx.dependencies)}


@task(executor="process", retries=1, backoff_base=60)  # the Retry's delay wins over 60 s
def retry_then_ok(ctx: Any, payload: Any) -> int:
    if ctx.attempt == 1:
        raise Retry("come back soon", delay=0.05)
    return int(ctx.attempt)


registry.add(reads_previous)
registry.add(segfaults)
registry.add(retry_then_ok)


@task(executor="process", retries=0)
def exits(ctx: Any, payload: Any) -> None:
    raise SystemExit(3)  # the job's failure, not the worker's exit


registry.add(exits)


@task(executor="process", retries=0)
def size_of(ctx: Any, payload: Any) -> int:
    return len(payload)


registry.add(size_of)
