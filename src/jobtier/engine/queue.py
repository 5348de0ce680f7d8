"""``Queue``: the engine for in-process callers, three faces over one Store.

- ``produce`` (``Producer``): prepare and submit jobs, batches and flows;
- ``jobs`` (``JobControl``): status, result, cancel, replay, dead letters, log lines,
  dependencies;
- ``admin`` (``QueueAdmin``): queues' state, pause, purge, flow limits, live workers.

The stores the engine needs beside Redis are given, never opened behind the caller's back:
``results`` reads results kept outside Redis, ``callbacks`` writes jobs' own webhooks.
"""

from __future__ import annotations

from typing import TypedDict, Unpack

from jobtier.config import Settings
from jobtier.core.model import TaskLookup
from jobtier.engine.control import JobControl, ResultReader
from jobtier.engine.produce import Producer, Registrar
from jobtier.engine.queue_admin import QueueAdmin
from jobtier.store.context import Store


class QueueOptions(TypedDict, total=False):
    """A ``Queue``'s options beside its store (or settings) and tasks."""

    require_known: bool  # refuse a job whose type ``tasks`` does not know (default: True)
    results: ResultReader | None  # reads results kept outside Redis
    callbacks: Registrar | None  # writes jobs' own webhooks (without: such a job is refused)


class Queue:
    """Producer, job and admin access to one jobtier deployment.

    >>> async with await Queue.connect(Settings.from_env()) as queue:
    ...     job = await queue.submit("resize", {"image": "a.png"}, priority="high")
    """

    def __init__(
        self, store: Store, tasks: TaskLookup | None = None, **options: Unpack[QueueOptions]
    ) -> None:
        if unknown := options.keys() - QueueOptions.__annotations__.keys():
            raise TypeError(f"no such option of Queue: {', '.join(sorted(unknown))}")
        self.store = store
        self.settings = store.settings
        self.redis = store.redis
        self.keys = store.keys
        self.scripts = store.scripts
        self.close = store.close
        require_known, callbacks = options.get("require_known", True), options.get("callbacks")
        self.produce = Producer(store, tasks, require_known, callbacks)
        self.jobs = JobControl(store, options.get("results"))
        self.admin = QueueAdmin(store)
        # the calls most used, on the queue itself
        self.submit = self.produce.submit
        self.submit_many = self.produce.submit_many
        self.submit_flow = self.produce.submit_flow
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
        **options: Unpack[QueueOptions],
    ) -> Queue:
        """Connect to the deployment's Redis (``Store.connect``); ``close`` closes it."""
        return cls(await Store.connect(settings, check=check), tasks, **options)

    async def __aenter__(self) -> Queue:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
