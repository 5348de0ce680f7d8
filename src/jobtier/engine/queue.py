"""``Queue``: the engine for in-process callers, three faces over one Store.

- ``produce`` (``Producer``): prepare and submit jobs, batches and flows;
- ``jobs`` (``JobControl``): status, result, cancel, replay, dead letters, log lines,
  dependencies;
- ``admin`` (``QueueAdmin``): queues' state, pause, purge, flow limits, live workers.

The stores the engine needs beside Redis are given, never opened behind the caller's back:
``results`` reads results kept outside Redis, ``callbacks`` writes jobs' own webhooks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jobtier.config import Settings
from jobtier.core.errors import IdempotencyConflict
from jobtier.core.model import FlowJob, FlowSubmitted, JobSpec, JobStatus, Submitted, TaskLookup
from jobtier.engine.control import JobControl, ResultReader
from jobtier.engine.produce import DEFAULT_TENANT, Describes, Producer, Registrar
from jobtier.engine.queue_admin import QueueAdmin
from jobtier.store.context import Store


class Queue:
    """Producer, job and admin access to one jobtier deployment.

    >>> async with await Queue.connect(Settings.from_env()) as queue:
    ...     job = await queue.submit("resize", {"image": "a.png"}, priority="high")
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
        self.store = store
        self.settings = store.settings
        self.redis = store.redis
        self.keys = store.keys
        self.scripts = store.scripts
        self.produce = Producer(store, tasks, require_known=require_known, callbacks=callbacks)
        self.jobs = JobControl(store, results)
        self.admin = QueueAdmin(store)

    @classmethod
    async def connect(
        cls,
        settings: Settings,
        tasks: TaskLookup | None = None,
        *,
        check: bool = True,
        results: ResultReader | None = None,
        callbacks: Registrar | None = None,
    ) -> Queue:
        """Connect to the deployment's Redis (``Store.connect``); ``close`` closes it."""
        store = await Store.connect(settings, check=check)
        return cls(store, tasks, results=results, callbacks=callbacks)

    async def close(self) -> None:
        await self.store.close()

    async def __aenter__(self) -> Queue:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def submit(self, type: str | Describes, payload: Any = None, **options: Any) -> Submitted:
        """``Producer.submit``: one job."""
        return await self.produce.submit(type, payload, **options)

    async def submit_many(
        self, specs: Sequence[JobSpec], *, tenant: str = DEFAULT_TENANT
    ) -> list[Submitted | IdempotencyConflict]:
        """``Producer.submit_many``: a batch, validated whole before any is sent."""
        return await self.produce.submit_many(specs, tenant=tenant)

    async def submit_flow(
        self,
        jobs: Sequence[FlowJob],
        *,
        tenant: str = DEFAULT_TENANT,
        idempotency_key: str | None = None,
    ) -> FlowSubmitted:
        """``Producer.submit_flow``: jobs that wait for others."""
        return await self.produce.submit_flow(jobs, tenant=tenant, idempotency_key=idempotency_key)

    async def status(self, job_id: str, tenant: str | None = None) -> JobStatus:
        return await self.jobs.status(job_id, tenant)

    async def result(self, job_id: str, tenant: str | None = None) -> tuple[JobStatus, Any]:
        """(status, result): the result is the task's return value once succeeded, else None."""
        return await self.jobs.result(job_id, tenant)

    async def cancel(self, job_id: str, tenant: str | None = None) -> JobStatus:
        """Cancel a waiting job, or ask the worker running it to stop."""
        return await self.jobs.cancel(job_id, tenant)
