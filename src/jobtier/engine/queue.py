"""``Queue``: the engine for in-process callers, three faces over one Store.

- ``produce`` (``Producer``): prepare and submit jobs, batches and flows;
- ``jobs`` (``JobControl``): status, result, cancel, replay, dead letters, log lines,
  dependencies;
- ``admin`` (``QueueAdmin``): queues' state, pause, purge, flow limits, live workers;
- ``explain``: why a job has not started (``engine/explain.py``).

The stores the engine needs beside Redis are given, never opened behind the caller's back:
``results`` reads results kept outside Redis, ``callbacks`` writes jobs' own webhooks.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Coroutine
from typing import Any, ParamSpec, TypeVar

from jobtier.config import Settings
from jobtier.core.model import TaskLookup
from jobtier.engine.batching import BatchControl
from jobtier.engine.catalog import TaskCatalog
from jobtier.engine.control import JobControl, ResultReader
from jobtier.engine.explain import Explainer
from jobtier.engine.produce import Producer, Registrar
from jobtier.engine.queue_admin import QueueAdmin
from jobtier.store import durable
from jobtier.store.context import Store

log = logging.getLogger("jobtier.engine.queue")

P = ParamSpec("P")
T = TypeVar("T")


class Queue:
    """Producer, job and admin access to one jobtier deployment.

    >>> async with await Queue.connect(Settings.from_env()) as queue:
    ...     job = await queue.submit("resize", {"image": "a.png"}, priority="high")

    Submitted by its name, a job gets its task's queue, attempts, payload check and
    compensation from ``tasks``: by default (``connect``) the workers' catalogue, as the
    API's submits do.
    """

    def __init__(
        self,
        store: Store,
        tasks: TaskLookup | None = None,
        *,
        require_known: bool = True,
        results: ResultReader | None = None,
        callbacks: Registrar | None = None,
    ) -> None:
        """``tasks``: where submits find a task's queue, attempts and payload check (with
        ``require_known``, a type it does not know is refused; without ``tasks``, nothing is
        looked up); ``results`` reads results kept outside Redis; ``callbacks`` writes jobs'
        own webhooks (without: such a job is refused). A ``TaskCatalog`` given as ``tasks``
        is the caller's to start and stop, unless ``connect`` made it."""
        self.store = store
        self.settings = store.settings
        self.redis = store.redis
        self.keys = store.keys
        self.scripts = store.scripts
        self._catalog: TaskCatalog | None = None  # made by connect: stopped by close
        self.produce = Producer(store, tasks, require_known, callbacks)
        self.jobs = JobControl(store, results)
        self.admin = QueueAdmin(store)
        self.explain = Explainer(store, self.admin).explain
        # the calls most used, on the queue itself; its submits honour
        # JOBTIER_SUBMIT_REPLICAS as the API's do
        self.submit = self._replicated(self.produce.submit)
        self.submit_many = self._replicated(self.produce.submit_many)
        self.submit_flow = self._replicated(self.produce.submit_flow)
        self.batches = BatchControl(store, self.produce)
        self.submit_batch = self._replicated(self.batches.submit)
        self.status = self.jobs.status
        self.result = self.jobs.result
        self.cancel = self.jobs.cancel

    @classmethod
    async def connect(
        cls,
        settings: Settings,
        tasks: TaskLookup | None = None,
        *,
        check: bool = True,
        catalog: bool = True,
        require_known: bool | None = None,
        results: ResultReader | None = None,
        callbacks: Registrar | None = None,
    ) -> Queue:
        """Connect to the deployment's Redis (``Store.connect``); ``close`` closes it.

        ``tasks``: a ``TaskRegistry`` of the tasks this process imports. Without it (and
        unless ``catalog=False``), the workers' catalogue: what every live worker, Python or
        HTTP, advertises of its tasks, read at once and refreshed as the API refreshes its
        own (engine/catalog.py). ``require_known``: refuse a type they do not know
        (``UnknownTask``); by default yes with a registry, and as
        ``JOBTIER_REQUIRE_KNOWN_TYPES`` says with the catalogue. With ``catalog=False`` and
        no registry nothing is looked up: a job's queue and attempts are those its submit
        names, else ``default`` and ``JOBTIER_DEFAULT_MAX_ATTEMPTS``."""
        store = await Store.connect(settings, check=check)
        made: TaskCatalog | None = None
        if tasks is None and catalog:
            made = TaskCatalog(store.redis, store.keys, ttl=settings.task_catalog_ttl)
            try:
                await made.load()
            except BaseException:
                await store.close()
                raise
            tasks = made
            if require_known is None:
                require_known = settings.require_known_types
        queue = cls(
            store,
            tasks,
            require_known=True if require_known is None else require_known,
            results=results,
            callbacks=callbacks,
        )
        if made is not None:
            made.start()
            queue._catalog = made
        return queue

    async def close(self) -> None:
        """Stop the catalogue ``connect`` made, and close the Store."""
        catalog, self._catalog = self._catalog, None
        try:
            if catalog is not None:
                await catalog.stop()
        finally:
            await self.store.close()

    def _replicated(
        self, call: Callable[P, Coroutine[Any, Any, T]]
    ) -> Callable[P, Coroutine[Any, Any, T]]:
        """``call`` returning only once its writes reached JOBTIER_SUBMIT_REPLICAS replicas
        (``store/durable.py``), else raising ``Unreplicated``: the jobs may exist, and a
        retry with the same idempotency key returns them. Unchanged with the setting 0, or
        inside a caller's own ``durable.waiting`` that asks for replicas."""
        wanted = self.settings.submit_replicas
        timeout_ms = self.settings.submit_replicas_timeout_ms
        if not wanted:
            return call

        @functools.wraps(call)
        async def replicated(*args: P.args, **kwargs: P.kwargs) -> T:
            if durable.current() is not None:
                return await call(*args, **kwargs)
            with durable.waiting(wanted, timeout_ms) as state:
                out = await call(*args, **kwargs)
                nothing = isinstance(out, list) and not out  # submit_many([])
                if not state.waits and not nothing:  # a repeat wrote nothing: the first's
                    await self.scripts.confirm(range(self.keys.shards))
            if state.short:
                log.warning(
                    "event=submit_unreplicated wanted=%d confirmed=%d timeout_ms=%d",
                    wanted, state.confirmed or 0, timeout_ms,
                )  # fmt: skip
                raise durable.Unreplicated(
                    f"{state.confirmed or 0} of {wanted} replicas confirmed the submit within "
                    f"{timeout_ms} ms (JOBTIER_SUBMIT_REPLICAS); the job may exist: submit again "
                    "with the same idempotency key to get it"
                )
            return out

        return replicated

    async def __aenter__(self) -> Queue:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
