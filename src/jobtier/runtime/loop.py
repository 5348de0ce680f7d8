"""Periodic work and the waits of long-running loops.

``every`` runs a step at an interval until stopped: a foreseen fault (Redis or Postgres
away) is logged in one line, anything else with its traceback the first time its class is
seen, and the next round tries again, so a periodic role never ends silently. ``wait_for``
is the stoppable sleep of every loop; ``wait_any`` returns as soon as one of several events
is set.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from redis.exceptions import RedisClusterException, RedisError

from jobtier.logs import Unforeseen

# Redis (or the network) away: redis-py's cluster client raises some of its own, such as a
# slot no node serves in the middle of a failover, from a class of their own
FAULTS: tuple[type[BaseException], ...] = (RedisError, RedisClusterException, OSError)


async def wait_for(event: asyncio.Event, seconds: float) -> bool:
    """Wait up to ``seconds`` for ``event``; True once it is set (at once if it already is)."""
    if not event.is_set() and seconds > 0:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await event.wait()
    return event.is_set()


async def wait_any(events: Iterable[asyncio.Event], seconds: float | None = None) -> bool:
    """Wait up to ``seconds`` (None: no bound) until one of ``events`` is set; True if one is."""
    waits = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        done, _ = await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
    return bool(done)


async def every(
    seconds: float | Callable[[], float],
    step: Callable[[], Awaitable[Any]],
    *,
    event: str,
    log: logging.Logger,
    stop: asyncio.Event | None = None,
    faults: tuple[type[BaseException], ...] = FAULTS,
    wait_first: bool = False,
    timeout: float | None = None,
) -> None:
    """Run ``step`` every ``seconds`` (a number, or a function asked before each wait) until
    ``stop`` is set or the task is cancelled. ``timeout`` bounds one step (a hung server);
    ``event`` names the step in the log line of a failure."""
    unforeseen = Unforeseen(log)
    stop = stop or asyncio.Event()
    first = True
    while True:
        wait = seconds() if callable(seconds) else seconds
        if (not first or wait_first) and await wait_for(stop, wait):
            return
        first = False
        try:
            async with asyncio.timeout(timeout):
                await step()
        except faults as exc:  # a TimeoutError (past ``timeout``) is an OSError
            log.warning("event=%s_failed error=%r", event, exc)
        except Exception as exc:
            unforeseen(f"event={event}_failed", exc, wait)
