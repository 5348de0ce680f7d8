"""Per-tick request coalescing: the distinct keys asked for in one event-loop tick, one load."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable, Mapping
from typing import Generic, TypeVar

from jobtier.status.singleflight import Flight, LoadCancelled, settle, wait

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

LoadMany = Callable[[list[K]], Awaitable[Mapping[K, V | BaseException | None]]]


class Coalescer(Generic[K, V]):
    """Merges the loads of one event-loop tick into batched ``load_many(keys)`` calls.

    The algorithm: the first ``get`` of a key that is not in flight adds it to the tick's
    pending list and, if that list was empty, schedules a flush with ``loop.call_soon``.
    Everything else that runs in the same tick (every request task the server woke in this
    iteration of the loop) joins that list; the flush runs in the next iteration and hands
    the list, cut into batches of at most ``max_batch`` keys, to ``load_many``, each batch in
    a task of its own. Missing keys (absent from the returned mapping) give ``None``; a key
    whose value is an exception failed alone (its waiters get the exception, the batch's
    other keys their values).

    It is a singleflight at the same time: a key already pending in this tick, or in a batch
    still loading, is joined, never requested twice, with singleflight.py's guarantees (a
    batch runs in its own task, which no cancelled waiter cancels). A batch's keys are
    removed before its waiters wake, so an error — ``TimeoutError`` past ``timeout`` for a
    batch that hangs — is not cached.

    Race it guards: a key joined while its batch is loading gets that batch's value, which
    may predate the join by up to one round trip. Callers that must not see a value older
    than their request (the near cache) order results by version, not by arrival.
    """

    __slots__ = (
        "_flights",
        "_load_many",
        "_pending",
        "_tasks",
        "batches",
        "joined",
        "keys_loaded",
        "max_batch",
        "max_batch_size",
        "requests",
        "timeout",
    )

    def __init__(
        self,
        load_many: LoadMany[K, V],
        *,
        max_batch: int = 500,
        timeout: float | None = None,
    ) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        self._load_many = load_many
        self.max_batch = max_batch
        self.timeout = timeout
        self._flights: dict[K, Flight[V | None]] = {}  # pending or loading
        self._pending: list[tuple[K, Flight[V | None]]] = []  # this tick's new keys
        self._tasks: set[asyncio.Task[None]] = set()  # strong refs to loading batches
        self.requests = 0  # get() calls
        self.joined = 0  # of which joined a key already pending or loading
        self.batches = 0  # load_many() calls
        self.keys_loaded = 0  # keys passed to load_many()
        self.max_batch_size = 0

    def __len__(self) -> int:
        """Keys pending or loading."""
        return len(self._flights)

    def __contains__(self, key: object) -> bool:
        return key in self._flights

    @property
    def avg_batch_size(self) -> float:
        return self.keys_loaded / self.batches if self.batches else 0.0

    @property
    def coalescing_factor(self) -> float:
        """Requests that reached the coalescer per ``load_many`` call."""
        return self.requests / self.batches if self.batches else 0.0

    async def get(self, key: K) -> V | None:
        self.requests += 1
        flight = self._flights.get(key)
        if flight is None:
            flight = self._flights[key] = Flight()
            if not self._pending:
                asyncio.get_running_loop().call_soon(self._flush)
            self._pending.append((key, flight))
        else:
            self.joined += 1
        return await wait(flight)

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        loop = asyncio.get_running_loop()
        for start in range(0, len(pending), self.max_batch):
            task = loop.create_task(self._run(pending[start : start + self.max_batch]))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _run(self, batch: list[tuple[K, Flight[V | None]]]) -> None:
        keys = [key for key, _ in batch]
        self.batches += 1
        self.keys_loaded += len(keys)
        if len(keys) > self.max_batch_size:
            self.max_batch_size = len(keys)
        values: list[V | BaseException | None] | None = None
        error: BaseException | None = None
        try:
            async with asyncio.timeout(self.timeout):
                found = await self._load_many(keys)
            values = [found.get(key) for key in keys]
        except Exception as exc:  # TimeoutError included: delivered to each waiter once
            error = exc
        except BaseException as exc:
            # the batch task was cancelled from outside (loop shutdown): tell the waiters
            error = LoadCancelled(f"batch load of {len(keys)} keys was cancelled")
            error.__cause__ = exc
            raise
        finally:
            flights = self._flights
            for i, (key, flight) in enumerate(batch):
                # forget the key before waking its waiters: errors are not cached
                if flights.get(key) is flight:
                    del flights[key]
                value = None if values is None else values[i]
                if isinstance(value, BaseException):  # this key's load failed alone
                    settle(flight, None, value)
                else:
                    settle(flight, value, error)
