"""``jobtier worker``'s process-pool options (worker/procpool.py, docs/process-pool.md)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from jobtier.core.model import WORKER_BLOCKED_WARN_LEAST

if TYPE_CHECKING:
    from jobtier.worker.procpool import ProcessOptions

MIB = 1024 * 1024


def _whole(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None


def _count(text: str) -> int:
    value = _whole(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {value}")
    return value


def at_least_one(text: str) -> int:
    """An argument's whole number of at least 1 (a concurrency, a count of processes)."""
    value = _whole(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def port(text: str) -> int:
    """An argument's TCP port, 1 to 65535."""
    value = _whole(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port, 1 to 65535, not {value}")
    return value


def seconds(text: str) -> float:
    """An argument's seconds, 0 or more."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be 0 or more seconds, not {text}")
    return value


LOCK_TIMEOUT_MOST = 2_147_483  # seconds: Postgres's lock_timeout is a 32-bit count of ms


def lock_seconds(text: str) -> float:
    """An argument's Postgres lock_timeout in seconds: more than 0, at most
    ``LOCK_TIMEOUT_MOST``."""
    value = seconds(text)
    if not 0 < value <= LOCK_TIMEOUT_MOST:
        raise argparse.ArgumentTypeError(
            f"must be more than 0 and at most {LOCK_TIMEOUT_MOST} seconds, not {text}"
        )
    return value


def watch_seconds(text: str) -> float:
    """``--blocked-warn``: 0 (off), or at least WORKER_BLOCKED_WARN_LEAST seconds."""
    value = seconds(text)
    if 0 < value < WORKER_BLOCKED_WARN_LEAST:
        raise argparse.ArgumentTypeError(
            f"must be 0 (off) or at least {WORKER_BLOCKED_WARN_LEAST:g} seconds, not {text}"
        )
    return value


PROCESS_ARGS: tuple[tuple[tuple[str, ...], dict[str, Any]], ...] = (
    (
        ("--executor",),
        {
            "choices": ["thread", "process"],
            "default": "thread",
            "help": "where plain def tasks that name no executor run: the worker's thread pool, "
            "or a pool of child processes for CPU-bound work (default: thread)",
        },
    ),
    (
        ("--processes",),
        {
            "type": at_least_one,
            "help": "child processes of the process pool (default: the CPU count)",
        },
    ),
    (
        ("--process-max-jobs",),
        {
            "type": _count,
            "default": 0,
            "help": "jobs a child process runs before it is replaced (default: 0, no limit)",
        },
    ),
    (
        ("--process-max-rss",),
        {
            "type": _count,
            "default": 0,
            "metavar": "MIB",
            "help": "resident memory (MiB) after a job past which a child process is replaced "
            "(default: 0, no limit)",
        },
    ),
)


def process_options(args: argparse.Namespace) -> ProcessOptions:
    from jobtier.worker.procpool import ProcessOptions

    size = {"size": args.processes} if args.processes is not None else {}
    return ProcessOptions(
        max_jobs=args.process_max_jobs, max_rss_bytes=args.process_max_rss * MIB, **size
    )
