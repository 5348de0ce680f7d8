"""Run a real worker over your tasks until the ready queues are empty (the ``jobtier_worker``
fixture)."""

from __future__ import annotations

import asyncio
from types import ModuleType
from typing import Any

from jobtier.core.errors import ConfigError, JobNotFound, TransitionRefused
from jobtier.engine.queue import Queue
from jobtier.flows.resolver import Resolver
from jobtier.worker.registry import Task, TaskRegistry
from jobtier.worker.runner import Worker, WorkerStats

Tasks = TaskRegistry | Task | ModuleType | str | list[Task] | tuple[Task, ...]


def as_registry(tasks: Tasks) -> TaskRegistry:
    """A registry from what a test names: a ``TaskRegistry``, one ``Task`` or a list of them,
    a module (every ``@task`` in it) or ``"module[:attr]"`` as ``jobtier worker`` takes."""
    if isinstance(tasks, TaskRegistry):
        return tasks
    if isinstance(tasks, Task):
        return TaskRegistry([tasks])
    if isinstance(tasks, ModuleType):
        return TaskRegistry.load(tasks.__name__)
    if isinstance(tasks, str):
        return TaskRegistry.load(tasks)
    if isinstance(tasks, list | tuple) and all(isinstance(t, Task) for t in tasks):
        return TaskRegistry(tasks)
    raise ConfigError(
        f"tasks {tasks!r}: give a TaskRegistry, a @task, a list of them, a module "
        "or 'module[:attr]'"
    )


class BurstWorker:
    """``await jobtier_worker()`` runs a ``Worker(burst=True)`` over the tasks until no job is
    ready or running, and returns its ``WorkerStats``. Flows run to their end: between bursts
    a resolver tells the dependents of the finished jobs, and a burst runs again while that
    made jobs ready. A failed attempt with retries left is *scheduled*, not ready, and so is
    a delayed job: the burst ends without them (nothing runs the scheduler), unless
    ``fast_forward=True``, which runs them without waiting for their time.
    """

    def __init__(self, queue: Queue, tasks: Tasks | None = None) -> None:
        self.queue = queue
        self.tasks = tasks

    async def __call__(
        self,
        tasks: Tasks | None = None,
        *,
        concurrency: int = 10,
        timeout: float = 60.0,
        fast_forward: bool = False,
        **worker_options: Any,
    ) -> WorkerStats:
        """Drain the ready queues with a burst worker over ``tasks`` (default: the
        ``jobtier_tasks`` fixture's). ``timeout`` bounds the run: past it the worker is
        stopped (its running jobs released after ``shutdown_grace``, 1 s here) and
        ``TimeoutError`` raised, so a task that hangs fails the test instead of hanging it.
        ``fast_forward``: time runs ahead for the scheduled jobs: after each burst, every
        job still scheduled (delayed, debounced or throttled, or waiting out a retry's
        back-off) is made ready now, as ``Queue.jobs.promote`` does (attempts unchanged), and
        a burst runs again, until none is left: a retried job runs to its last attempt.
        ``worker_options`` go to ``Worker`` (e.g. ``progress_interval``)."""
        chosen = tasks if tasks is not None else self.tasks
        if chosen is None:
            raise ConfigError(
                "jobtier_worker has no tasks: pass them (`await jobtier_worker(my_tasks)`) or "
                "override the `jobtier_tasks` fixture to return them"
            )
        worker_options.setdefault("shutdown_grace", 1.0)
        registry = as_registry(chosen)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        stats = WorkerStats()  # the bursts' together
        resolver = Resolver(self.queue.store, name="jobtier-testing")
        options = dict(worker_options, concurrency=concurrency, burst=True, stats=stats)
        rounds = promoted = 0
        while True:
            worker = Worker(self.queue.store, registry, **options)
            try:
                await self._burst(worker, max(deadline - loop.time(), 0.0), timeout)
            except TimeoutError as exc:
                if not promoted:
                    raise
                raise TimeoutError(
                    f"fast_forward was still finding scheduled jobs after {timeout:g}s "
                    f"({rounds} rounds, {promoted} jobs promoted): does a task reschedule "
                    "itself (Retry, RateLimited, a submit with a delay) every attempt?"
                ) from exc
            told = await resolver.drain()  # dependents of the finished jobs made ready
            now = await self.promote_scheduled() if fast_forward and not told else 0
            if not told and not now:
                return stats  # nothing more to run
            rounds, promoted = rounds + 1, promoted + now

    async def promote_scheduled(self) -> int:
        """Make every scheduled job ready now (``fast_forward``); returns how many. One that
        left ``scheduled`` meanwhile is passed over."""
        store = self.queue.store
        promoted = 0
        for shard in range(store.keys.shards):
            for raw in await store.redis.zrange(store.keys.sched(shard), 0, -1):
                job_id = raw.decode() if isinstance(raw, bytes) else str(raw)
                try:
                    await self.queue.jobs.promote(job_id)
                except (TransitionRefused, JobNotFound):
                    continue
                promoted += 1
        return promoted

    @staticmethod
    async def _burst(worker: Worker, left: float, timeout: float) -> None:
        run = asyncio.ensure_future(worker.run())
        try:
            done, _ = await asyncio.wait({run}, timeout=left)
        except asyncio.CancelledError:  # the test was cancelled (its own timeout)
            worker.stop()
            await asyncio.wait({run}, timeout=worker.shutdown_grace + 10)
            raise
        if not done:
            running = sorted(worker.state.running)
            worker.stop()
            await run
            jobs = (
                f"with job(s) {', '.join(running[:10])} (released back to their queues)"
                if running
                else "between its jobs"
            )
            raise TimeoutError(
                f"the burst worker was still running after {timeout:g}s, {jobs}: does a task hang?"
            )
        run.result()
