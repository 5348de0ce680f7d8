"""Singleflight: concurrent callers for one key share one in-flight load.

The read path's singleflight is the per-tick coalescer (coalescer.py): a key already pending
in this tick, or in a batch still loading, is joined, never loaded twice. These are the
pieces it is made of: a :class:`Flight` (one load and its waiters), :func:`wait` and
:func:`settle`, which give every waiter the same guarantees: a cancelled waiter never
cancels the load, and an error reaches each waiter once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable
from types import TracebackType
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class LoadCancelled(Exception):
    """The shared load was cancelled from outside (shutdown), not by this waiter.

    Waiters get this rather than ``CancelledError``: a ``CancelledError`` in a task that
    nobody cancelled would read as "this request was cancelled" to asyncio and to servers.
    """


class Flight(Generic[V]):
    """One load and the waiters that share it.

    Every waiter parks on its own future, which only ever receives ``None`` (a wake-up): the
    outcome lives here. Futures that never hold an exception cannot produce "Future
    exception was never retrieved" when their waiter was cancelled in the same tick as the
    load failed, and a cancelled waiter cancels only its own future, never the load.
    """

    __slots__ = ("error", "task", "traceback", "value", "waiters")

    def __init__(self) -> None:
        self.waiters: list[asyncio.Future[None]] = []
        self.value: V | None = None
        self.error: BaseException | None = None
        self.traceback: TracebackType | None = None
        self.task: asyncio.Task[None] | None = None  # strong ref: the loop keeps only weak ones


async def wait(flight: Flight[V]) -> V:
    """Park until ``flight`` settles; return its value or raise its error (once per waiter)."""
    future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    flight.waiters.append(future)
    await future  # cancelling this waiter cancels only its own future
    if flight.error is not None:
        # Re-raise with the original traceback each time, as asyncio.Future.result() does:
        # a bare ``raise`` of one shared exception in 10,000 waiters would chain 10,000
        # frames onto its __traceback__.
        raise flight.error.with_traceback(flight.traceback)
    return flight.value  # type: ignore[return-value]  # V when error is None


def settle(flight: Flight[V], value: V | None, error: BaseException | None) -> None:
    """Record the outcome and wake every waiter still waiting (cancelled ones are skipped)."""
    flight.value = value
    if error is not None:
        flight.error = error
        flight.traceback = error.__traceback__
    for future in flight.waiters:
        if not future.done():
            future.set_result(None)
    flight.waiters = []
