"""An attempt whose large result goes to the result store before its success is reported.

With ``JOBTIER_RESULT_STORE`` set, a result over ``JOBTIER_RESULT_STORE_THRESHOLD_BYTES`` is
written to the store (committed) while the job is still this worker's — in ``_running``,
heartbeating, its lease kept — and only then reported, as a reference
(``persist/results.py``): the bytes never reach Redis, and a job reported succeeded always
has its result. An encrypted job's result is stored sealed (its size counted sealed).
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Executor

from jobtier.core.model import marker
from jobtier.core.sealing import Keyring
from jobtier.persist.results import ResultStore
from jobtier.worker.attempt import INTERRUPTED, AttemptSink, Failure, Stopped, run_attempt
from jobtier.worker.job_context import JobContext
from jobtier.worker.procpool import ProcessPool
from jobtier.worker.registry import Task

log = logging.getLogger("jobtier.worker")


class _Ended:
    """Holds how the attempt ended until the result is stored."""

    end: bytes | Failure | Stopped = INTERRUPTED

    def attempt_ended(self, ctx: JobContext, end: bytes | Failure | Stopped) -> None:
        self.end = end


async def run_attempt_storing(
    task: Task | None,
    ctx: JobContext,
    executor: Executor,
    max_result_bytes: int,
    sink: AttemptSink,
    store: ResultStore,
    threshold: int,
    keyring: Keyring | None = None,
    sealed_queue: bool = False,
    processes: ProcessPool | None = None,
) -> None:
    """``run_attempt``, with a result over ``threshold`` bytes stored first. A store that
    fails makes the attempt a retryable failure (the result is lost with it, not the job)."""
    ended = _Ended()
    await run_attempt(
        task, ctx, executor, max_result_bytes, ended, keyring, sealed_queue, processes
    )
    end = ended.end
    if isinstance(end, bytes) and len(end) > threshold:
        job = ctx.job
        try:
            end = marker(await store.put(job.id, job.lease_version, end))
        except asyncio.CancelledError:  # shutdown or a lost lease, as run_attempt treats it
            end = INTERRUPTED
        except Exception as exc:
            log.warning("event=result_store_failed job=%s size=%d error=%r", job.id, len(end), exc)
            message = f"the result store refused the result: {exc!r}"[:500]
            end = Failure(exc, "ResultStoreUnavailable", message, retry=True)
    sink.attempt_ended(ctx, end)
