"""What every long-running command shares: its event loop, its signals, its way out."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import sys
from collections.abc import Callable, Coroutine
from typing import Any

from jobtier.config import Settings
from jobtier.runtime import tracing
from jobtier.runtime.loop import FAULTS

log = logging.getLogger("jobtier.cli")


def run_async(main: Callable[[], Coroutine[Any, Any, int]]) -> int:
    try:
        import uvloop

        return uvloop.run(main())
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return asyncio.run(main())


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # SIGHUP: the terminal closed


def on_signals(
    stop: Callable[[], None],
    stop_now: Callable[[], None] | None = None,
    on_exit: Callable[[], None] | None = None,
) -> None:
    """SIGTERM, SIGINT (Ctrl-C) and SIGHUP (its terminal closed) stop the process.

    The first: ``stop()``, graceful. The second: ``stop_now()``, no more waiting, but still
    the clean-up that keeps its word (held jobs released to their queues, servers stopped).
    The next one, or the second when there is no ``stop_now``: ``on_exit()``, then exit on
    the spot.
    """
    loop = asyncio.get_running_loop()
    received: list[signal.Signals] = []

    def handler(sig: signal.Signals) -> None:
        received.append(sig)
        if len(received) == 1:
            log.info("event=signal signal=%s action=graceful_stop", sig.name)
            stop()
        elif len(received) == 2 and stop_now is not None:
            log.warning("event=signal signal=%s action=stop_now", sig.name)
            stop_now()
        else:
            log.warning("event=forced_exit signal=%s", sig.name)
            if on_exit is not None:
                on_exit()
            os._exit(1)

    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, handler, sig)


def exit_now_if_stuck(stuck: int, code: int) -> None:
    """Exit without joining what the worker could not stop (sync tasks' threads, tasks that
    ignored their cancellation): their jobs were released, and a normal exit would wait for
    them, past the grace. Everything else has been closed by now."""
    if stuck:
        log.warning("event=exit_without_waiting stuck=%d: tasks still running were released", stuck)
        tracing.shutdown()
        logging.shutdown()
        sys.stdout.flush()
        os._exit(code)


UNREACHABLE = FAULTS  # Redis (or the network) away: a clear line, not a traceback


def default_name(role: str) -> str:
    import socket

    return f"{role}-{socket.gethostname()}-{os.getpid()}"


def freeze_gc(settings: Settings) -> None:
    """With JOBTIER_GC_FREEZE: start-up objects (modules, tasks, compiled scripts) live as long
    as the process, so the collector stops walking them, and a higher first threshold runs it
    less often (a worker or persister makes a few tracked objects per job)."""
    if settings.gc_freeze:
        gc.collect()
        gc.freeze()
        gc.set_threshold(20_000, 50, 100)
