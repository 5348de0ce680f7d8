"""Singleflight: concurrent callers for one key share one in-flight load.

The shared pieces (:class:`Flight`, :func:`wait`, :func:`settle`) are also what the per-tick
coalescer builds on, so both give their waiters the same guarantees.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable
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


class SingleFlight(Generic[K, V]):
    """Deduplicates concurrent loads of the same key.

    ``do(key, load)``: the first caller (the leader) starts ``load()`` in a task of its own
    and every caller, the leader included, waits for that task's outcome. When it settles
    the key is forgotten, so the next call loads again: freshness is the near cache's job.

    Races and failures it guards:

    * leader cancelled: the load runs in its own task, so a cancelled caller (the leader
      too) stops waiting but the load carries on for the others;
    * all waiters cancelled: the load finishes unobserved, its result is dropped and the key
      removed; its task never ends with an exception, so nothing is logged as unretrieved;
    * the load raises: every waiter still waiting gets the exception raised once, and the
      key is removed first, so the error is not cached and the next call starts a new load;
    * the load hangs: with ``timeout`` set, the load is cancelled after that many seconds,
      every waiter gets ``TimeoutError`` and the key is freed. Without a timeout a hung load
      holds its key (and its waiters) until it returns.
    """

    __slots__ = ("_flights", "loads", "timeout")

    def __init__(self, timeout: float | None = None) -> None:
        self.timeout = timeout
        self._flights: dict[K, Flight[V]] = {}
        self.loads = 0  # loads started

    def __len__(self) -> int:
        """Keys with a load in flight."""
        return len(self._flights)

    def __contains__(self, key: object) -> bool:
        return key in self._flights

    async def do(self, key: K, load: Callable[[], Awaitable[V]]) -> V:
        flight = self._flights.get(key)
        if flight is None:
            flight = self._flights[key] = Flight()
            flight.task = asyncio.create_task(self._run(key, flight, load))
            self.loads += 1
        return await wait(flight)

    async def _run(self, key: K, flight: Flight[V], load: Callable[[], Awaitable[V]]) -> None:
        value: V | None = None
        error: BaseException | None = None
        try:
            async with asyncio.timeout(self.timeout):
                value = await load()
        except Exception as exc:  # TimeoutError included: delivered to every waiter
            error = exc
        except BaseException as exc:
            # cancelled from outside (loop shutdown): tell the waiters, then stay cancelled
            error = LoadCancelled(f"load of {key!r} was cancelled")
            error.__cause__ = exc
            raise
        finally:
            # forget the key before waking anyone: an error is never cached, and a waiter
            # that calls again on wake-up starts a fresh load
            if self._flights.get(key) is flight:
                del self._flights[key]
            settle(flight, value, error)
